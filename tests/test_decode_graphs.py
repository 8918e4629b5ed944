"""Decode steps through DecodeGraphs' fixed buffers: the same tokens as eager steps and as transformers + peft.

On a CPU the padded forward runs eagerly (`capture=False`) with the Triton kernels interpreted: that proves the
buffers, the padding rows and the one-segment-per-row LoRA meta. On a GPU the engine records real CUDA graphs by
default, and the test marked gpu compares it with an `enforce_eager` engine and with peft.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from peft import PeftModel

from adapters.ref import LoRARequest
from engine import decode_graphs
from engine.decode_graphs import DecodeGraphs, graph_batch_sizes
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kernels.lora.meta import fill_graph_layout
from tests.hf_models import make_adapter, make_model
from tests.test_oracle import prompts

# The CPU engine's Triton kernels run interpreted; where CUDA is (TRITON_INTERPRET unset) Triton compiles for it only
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="a CPU engine's Triton kernels need the interpreter"
)
# three adapters for two device rows: five seqs decode together (padded to the bucket of 6), then a2 loads into a row
# they freed and decodes alone
NAMES = [None, "a0", "a1", "a2", "a0", None]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("graphs")
    hf = make_model(directory / "base", tokenizer, "llama")
    hf.generation_config.eos_token_id = None
    paths = {f"a{i}": make_adapter(hf, directory / f"a{i}", seed=10 + i, r=8) for i in range(3)}
    peft_model = PeftModel.from_pretrained(copy.deepcopy(hf), paths["a0"], adapter_name="a0")
    for name in ("a1", "a2"):
        peft_model.load_adapter(paths[name], adapter_name=name)
    peft_model.eval()
    return directory / "base", peft_model, {name: LoRARequest(name, path) for name, path in paths.items()}


def engine(model_dir, device: str, **options) -> LLM:
    return LLM(
        model=str(model_dir),
        device=device,
        dtype="float32",
        attention_backend="triton",
        lora_backend="triton",
        num_kv_blocks=128,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        # a fixed thread team: the two engines' sums must round alike whatever a neighbour does (this test failed
        # once, right after a benchmark's processes ended; a team resized mid-run would explain it)
        cpu_threads_adapt=False,
        **{"max_num_seqs": 6, **options},  # buckets 1, 2, 4, 6: five seqs pad to six
    )


@pytest.fixture(scope="module")
def eager_outputs(setup):
    """(prompts, outputs) of the eager CPU engine (no decode graphs there): what the padded buffers' steps must give."""
    model_dir, _, loras = setup
    eager = engine(model_dir, "cpu")
    assert eager.engine.runner.decode_graphs is None  # a CPU engine runs eagerly
    return generate(eager, loras)


def with_padded_graphs(llm: LLM) -> DecodeGraphs:
    """Gives a CPU engine's runner DecodeGraphs whose padded steps run eagerly (capture=False); returns them."""
    runner = llm.engine.runner
    runner.decode_graphs = runner.make_decode_graphs(llm.engine.max_model_len, capture=False)
    return runner.decode_graphs


def generate(llm: LLM, loras: dict, max_tokens: int = 8):
    batch = prompts(llm.engine.runner.arch.vocab_size, len(NAMES), seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    return batch, llm.generate(batch, params, lora_request=[loras.get(n) for n in NAMES])


def peft_greedy(peft_model, prompt: list[int], name: str | None, max_tokens: int) -> list[int]:
    with torch.no_grad():
        if name is None:
            with peft_model.disable_adapter():
                ref = peft_model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
        else:
            peft_model.set_adapter(name)
            ref = peft_model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
    return ref[0, len(prompt) :].tolist()


def counting_runs(graphs: DecodeGraphs) -> list[int]:
    """Records the size of every step `graphs` runs."""
    sizes, run = [], graphs.run

    def counted(batch):
        sizes.append(len(batch.seqs))
        return run(batch)

    graphs.run = counted
    return sizes


def assert_same_outputs(ours, reference) -> None:
    for out, ref in zip(ours, reference, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for step, ref_step in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True):
            assert step.top_logprobs.keys() == ref_step.top_logprobs.keys()
            for token_id, logprob in step.top_logprobs.items():
                assert logprob == pytest.approx(ref_step.top_logprobs[token_id], abs=1e-4)


@pytest.mark.parametrize(
    ("max_num_seqs", "sizes"),
    [(1, [1]), (3, [1, 2, 3]), (6, [1, 2, 4, 6]), (20, [1, 2, 4, 8, 16, 20]), (2048, [1, 2, 4, *range(8, 513, 8)])],
)
def test_buckets_cover_every_batch_size_once(max_num_seqs, sizes):
    assert graph_batch_sizes(max_num_seqs) == sizes


@interpreted
def test_padded_decode_steps_match_eager_steps_and_peft(setup, eager_outputs):
    """The padded buffers' steps (run eagerly on the CPU) give the eager engine's tokens and logprobs, and peft's
    greedy tokens per adapter, over a mixed batch whose third adapter loads into a row freed mid-run."""
    model_dir, peft_model, loras = setup
    batch, expected = eager_outputs
    llm = engine(model_dir, "cpu")
    sizes = counting_runs(with_padded_graphs(llm))
    _, ours = generate(llm, loras)
    assert_same_outputs(ours, expected)
    assert len(sizes) >= 7 and 5 in sizes  # decode steps went through the buffers, padded ones too
    for prompt, name, out in zip(batch, NAMES, ours):
        assert out.outputs[0].token_ids == peft_greedy(peft_model, prompt, name, 8), f"adapter {name}"
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and llm.engine.adapter_cache.num_pinned == 0


@interpreted
def test_a_step_keeps_the_lora_layout_while_its_adapter_rows_do_not_change(setup, eager_outputs, monkeypatch):
    """The host buffers' LoRA layout is made again only when a step's adapter rows differ from the last step's (the
    five seqs decoding together, then a2 alone on a row they freed), and the tokens stay the eager engine's."""
    model_dir, _, loras = setup
    _, expected = eager_outputs
    llm = engine(model_dir, "cpu")
    graphs = with_padded_graphs(llm)
    steps_rows, run = [], graphs.run

    def recorded(batch):
        steps_rows.append([seq.adapter_idx for seq in batch.seqs])  # NO_ADAPTER (-1) where a seq has none
        return run(batch)

    layouts = []
    monkeypatch.setattr(graphs, "run", recorded)
    monkeypatch.setattr(decode_graphs, "fill_graph_layout", lambda rows, *out: layouts.append(list(rows)) or
                        fill_graph_layout(rows, *out))  # fmt: skip
    _, ours = generate(llm, loras)
    assert_same_outputs(ours, expected)
    changes = [rows for previous, rows in zip([[], *steps_rows], steps_rows) if rows != previous]
    assert layouts == changes and 2 <= len(changes) < len(steps_rows)


@interpreted
def test_the_staging_buffers_reach_the_device_in_contiguous_copies(setup, eager_outputs, monkeypatch):
    """Every copy from the host staging buffers reads a contiguous source (on CUDA a strided one goes through a
    pageable temporary, which waits for the stream), and the steps still give the eager engine's tokens."""
    model_dir, _, loras = setup
    _, expected = eager_outputs
    llm = engine(model_dir, "cpu")
    graphs = with_padded_graphs(llm)
    staging = {t.untyped_storage().data_ptr() for t in (graphs.host_ids, graphs.host_lens, graphs.host_tables)}
    copies, copy_ = [], torch.Tensor.copy_

    def recorded(dst, src, non_blocking=False):
        if src.untyped_storage().data_ptr() in staging:
            copies.append((tuple(src.shape), src.is_contiguous()))
        return copy_(dst, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", recorded)
    _, ours = generate(llm, loras)
    monkeypatch.undo()
    assert_same_outputs(ours, expected)
    assert all(contiguous for _, contiguous in copies), copies
    tables = [shape for shape, _ in copies if shape[-1] == graphs.max_blocks]
    assert len(copies) >= 3 * 7 and len(tables) >= 7  # three copies a step, the block tables' among them


@interpreted
def test_split_k_shrink_and_grouped_expand_match_eager_steps_and_peft(setup, eager_outputs, monkeypatch):
    """The tiny model's LoRA layers with the shrink split into parts of H_in (16 columns a step, as if on a device of
    64 multiprocessors) and two column tiles per expand program, through the padded buffers and eager prefill
    steps: the plain kernels' tokens and logprobs, and peft's greedy tokens."""
    import kernels.lora.triton_ops as triton_ops

    model_dir, peft_model, loras = setup
    _, expected = eager_outputs
    monkeypatch.setattr(triton_ops, "FUSE_MAX_REPEATED_K", 0)  # the tiny model's layers would take one launch
    monkeypatch.setattr(triton_ops, "SHRINK_BLOCK_K", 32)  # 16 fp32 columns a step: 4 steps of the model's H_in 64
    monkeypatch.setattr(triton_ops, "multiprocessors", lambda device: 64)
    monkeypatch.setattr(triton_ops, "expand_group_tiles", lambda programs, device: 2)
    parts, partials = [], triton_ops._partials
    monkeypatch.setattr(triton_ops, "_partials", lambda buffer: parts.append(buffer.dim()) or partials(buffer))
    llm = engine(model_dir, "cpu")
    with_padded_graphs(llm)
    batch, ours = generate(llm, loras)
    assert 3 in parts  # some shrinks wrote partial sums
    assert_same_outputs(ours, expected)
    for prompt, name, out in zip(batch, NAMES, ours):
        assert out.outputs[0].token_ids == peft_greedy(peft_model, prompt, name, 8), f"adapter {name}"


@interpreted
def test_fused_lora_steps_match_two_kernel_steps_and_peft(setup, monkeypatch):
    """The tiny model's LoRA layers in one launch each (its H_in of 64 fuses by default), through the padded
    buffers and eager prefill steps: the shrink-then-expand engine's tokens and logprobs, and peft's greedy tokens."""
    import kernels.lora.triton_ops as triton_ops

    model_dir, peft_model, loras = setup
    monkeypatch.setattr(triton_ops, "FUSE_MAX_REPEATED_K", 0)
    two_kernels = engine(model_dir, "cpu")
    with_padded_graphs(two_kernels)
    _, expected = generate(two_kernels, loras)
    monkeypatch.undo()
    fused, launch = [], triton_ops._fused  # the tokens of each fused launch (its y's rows)
    monkeypatch.setattr(triton_ops, "_fused", lambda grid, y, *args: fused.append(y.shape[0]) or launch(grid, y, *args))
    llm = engine(model_dir, "cpu")
    with_padded_graphs(llm)
    batch, ours = generate(llm, loras)
    assert 6 in fused and max(fused) > 6  # padded decode steps and prefill steps went through the fused kernel
    assert_same_outputs(ours, expected)
    for prompt, name, out in zip(batch, NAMES, ours):
        assert out.outputs[0].token_ids == peft_greedy(peft_model, prompt, name, 8), f"adapter {name}"


@interpreted
def test_a_step_the_buffers_cannot_hold_runs_eagerly(setup):
    """Prefill steps, and batches past the largest bucket, take the eager path."""
    model_dir, _, loras = setup
    llm = engine(model_dir, "cpu")
    runner = llm.engine.runner
    graphs = DecodeGraphs(  # up to 2 seqs: 5 decode eagerly, the last 2 in the buffers
        runner.model, runner.block_size, llm.engine.max_model_len, 2, 2, runner.device, capture=False
    )
    graphs.capture_all()
    runner.decode_graphs = graphs
    sizes = counting_runs(graphs)
    batch = prompts(runner.arch.vocab_size, len(NAMES), seed=4)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 2, 2, 6, 6, 2)]
    ours = llm.generate(batch, params, lora_request=[loras.get(n) for n in NAMES])
    assert sizes and set(sizes) <= {1, 2}  # the last two seqs' steps only
    eager = engine(model_dir, "cpu")
    for out, ref in zip(ours, eager.generate(batch, params, lora_request=[loras.get(n) for n in NAMES])):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids


@pytest.mark.gpu
def test_cuda_graph_steps_match_eager_steps_and_peft(setup):
    model_dir, peft_model, loras = setup
    llm = engine(model_dir, "cuda")
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.capture and len(graphs.graphs) == 2 * len(graphs.batch_sizes)
    sizes = counting_runs(graphs)
    batch, ours = generate(llm, loras)
    assert len(sizes) >= 7
    eager = engine(model_dir, "cuda", enforce_eager=True)
    assert eager.engine.runner.decode_graphs is None
    _, expected = generate(eager, loras)
    assert_same_outputs(ours, expected)
    for prompt, name, out in zip(batch, NAMES, ours):
        assert out.outputs[0].token_ids == peft_greedy(peft_model, prompt, name, 8), f"adapter {name}"
