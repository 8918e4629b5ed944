"""GGUF files: our engine against transformers loading the same file (fp32 logits, greedy tokens, dequantized
weights), the tokenizer and chat template of a real model, and a clear error for each kind of bad file."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from engine.config import EngineConfig
from engine.gguf_reader import GGUFError, read_gguf
from engine.llm import LLM
from engine.models.arch import UnsupportedModelError
from engine.sampling_params import SamplingParams
from tests.gguf_models import write_gguf
from tests.hf_models import make_model
from tests.test_oracle import our_prompt_logits

Q = GGMLQuantizationType
WIDE = {"hidden_size": 256, "intermediate_size": 512}  # rows of 256: the K-quants' block


def hf_from_gguf(path: Path) -> torch.nn.Module:
    """transformers' own GGUF loader (it dequantizes with gguf too), fp32, generating exactly max_new_tokens."""
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def engine(path: Path) -> LLM:
    return LLM(model=str(path), dtype="float32", device="cpu", num_kv_blocks=64, max_num_batched_tokens=256)


def prompt(vocab_size: int, length: int = 21, seed: int = 0) -> list[int]:
    return torch.randint(3, vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_same_model(path: Path, prompt_ids: list[int], new_tokens: int = 6) -> None:
    """Our engine on `path` against transformers on `path`: weights, prompt logits, greedy continuation."""
    hf, llm = hf_from_gguf(path), engine(path)
    ours = read_gguf(path).state_dict()
    for name, reference in hf.state_dict().items():
        if name in ours:  # a tied lm_head is only embed_tokens in ours
            torch.testing.assert_close(ours[name], reference, atol=0, rtol=0, msg=name)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt_ids])).logits[0]  # [L, V]
        greedy = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=new_tokens, do_sample=False)
    torch.testing.assert_close(our_prompt_logits(llm, prompt_ids), expected, atol=1e-4, rtol=1e-4)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    out = llm.generate([prompt_ids], params)[0].outputs[0]
    assert out.token_ids == greedy[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    return make_model(tmp_path_factory.mktemp("tiny-hf"), tokenizer, "llama")


@pytest.fixture(scope="module")
def wide(tmp_path_factory, tokenizer):
    return make_model(tmp_path_factory.mktemp("wide-hf"), tokenizer, "llama", **WIDE)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_tiny_llama_gguf_matches_transformers(qtype, tiny, tokenizer, tmp_path):
    path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", tiny, tokenizer, Q[qtype])
    assert_same_model(path, prompt(tiny.config.vocab_size))


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_gguf_matches_transformers(qtype, wide, tokenizer, tmp_path):
    path = write_gguf(tmp_path / f"wide-{qtype}.gguf", wide, tokenizer, Q[qtype])
    assert_same_model(path, prompt(wide.config.vocab_size, length=9), new_tokens=3)


def test_f32_round_trip_gives_back_the_hf_weights(tiny, tokenizer, tmp_path):
    """Q/K rows un-permuted, shapes un-reversed, tied lm_head left out: exactly the checkpoint transformers saved."""
    gguf = read_gguf(write_gguf(tmp_path / "tiny.gguf", tiny, tokenizer))
    expected = {
        k: v for k, v in tiny.state_dict().items() if k != "lm_head.weight" or not gguf.arch.tie_word_embeddings
    }
    ours = gguf.state_dict()
    assert ours.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(ours[name], tensor, atol=0, rtol=0, msg=name)
    assert gguf.config["num_key_value_heads"] == tiny.config.num_key_value_heads
    assert gguf.eos_token_ids == [tokenizer.eos_token_id] and gguf.bos_token_id == tokenizer.bos_token_id
    ours = gguf.tokenizer
    assert ours.chat_template == tokenizer.chat_template
    assert (ours.bos_token_id, ours.eos_token_id, len(ours)) == (tokenizer.bos_token_id, tokenizer.eos_token_id, 512)
    text = "def f(x):\n    return x  # ok <|endoftext|>"  # no GPT-2 token beyond the vocabulary (transformers adds one)
    assert ours(text)["input_ids"] == tokenizer(text)["input_ids"]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_gguf_matches_transformers(arch, tokenizer, tmp_path):
    # transformers reads no head_dim from a qwen3 GGUF and takes Qwen3Config's 128: give the model that
    hf = make_model(tmp_path / "hf", tokenizer, arch, **({"head_dim": 128} if arch == "qwen3" else {}))
    path = write_gguf(tmp_path / f"tiny-{arch}.gguf", hf, tokenizer, Q.Q8_0, arch=arch)
    assert read_gguf(path).arch.architecture == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    assert_same_model(path, prompt(hf.config.vocab_size))


# ---- the real model ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf, smollm2_transformers) -> tuple[torch.nn.Module, LLM]:
    """transformers' model and our engine on the same SmolLM2 GGUF, loaded once for the module's tests."""
    return smollm2_transformers, engine(smollm2_gguf)


CONVERSATION = [
    {"role": "system", "content": "Answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France? Ünïcode ✓"},
]


def test_smollm2_logits_and_greedy_tokens_match_transformers(smollm2):
    """Over 30 real layers two fp32 computations each drift ~7e-5 from the exact logits, in different directions
    by CPU (oneDNN's kernels sum in their own order): so the logits are held to 1e-4 of transformers in float64,
    the answer both approximate, and to no more than twice transformers' own fp32 error. The greedy tokens are
    transformers' fp32 ones."""
    hf, llm = smollm2
    prompt_ids = llm.tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, return_dict=False)
    out = llm.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    with torch.no_grad():  # one forward over prompt + our tokens: the prompt's logits, and transformers' greedy picks
        logits = hf(torch.tensor([prompt_ids + out.token_ids[:-1]])).logits[0]  # [L + 3, 49152]
        exact = copy.deepcopy(hf).double()(torch.tensor([prompt_ids])).logits[0]  # [L, 49152] float64
    ours = our_prompt_logits(llm, prompt_ids).double()
    torch.testing.assert_close(ours, exact, atol=1e-4, rtol=1e-4)
    hf_error = (logits[: len(prompt_ids)].double() - exact).abs().max().item()
    assert (ours - exact).abs().max().item() <= 2 * hf_error
    assert out.token_ids == logits[len(prompt_ids) - 1 :].argmax(-1).tolist()


def test_smollm2_tokenizer_and_chat_template_match_transformers(smollm2, smollm2_gguf):
    _, llm = smollm2
    path = smollm2_gguf
    # what AutoTokenizer gives too (the same class), without its second full parse of the file for the config
    reference = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = llm.tokenizer
    assert ours.chat_template == reference.chat_template and "<|im_start|>" in ours.chat_template
    chat = ours.apply_chat_template(CONVERSATION, add_generation_prompt=True, return_dict=False)
    assert chat == reference.apply_chat_template(CONVERSATION, add_generation_prompt=True, return_dict=False)
    text = "  Hello wörld 123 <|im_end|>\n\n日本"
    assert ours(text)["input_ids"] == reference(text)["input_ids"]
    assert (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert llm.engine.eos_token_ids == {2}


# ---- bad files -------------------------------------------------------------------------------------------------


def test_truncated_gguf_names_the_file(tiny, tokenizer, tmp_path):
    path = write_gguf(tmp_path / "whole.gguf", tiny, tokenizer)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(GGUFError, match=r"cut\.gguf.*truncated"):
        engine(cut)


def test_non_gguf_file_names_the_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("{}: this is not a GGUF file\n" * 20)
    with pytest.raises(GGUFError, match=r"model\.gguf"):
        engine(path)
    with pytest.raises(FileNotFoundError, match=r"missing\.gguf"):
        EngineConfig(model=str(tmp_path / "missing.gguf"))


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "mamba.gguf"
    writer = GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))  # [vocab, hidden]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=r"'mamba' in .*mamba\.gguf"):
        engine(path)


def test_unsupported_tensor_type_is_named(wide, tokenizer, tmp_path):
    iq2 = np.zeros((256, 66), dtype=np.uint8)  # q_proj [256, 256]: one 66-byte IQ2_XXS block of 256 per row
    path = write_gguf(tmp_path / "iq2.gguf", wide, tokenizer, Q.Q8_0, raw={"blk.1.attn_q.weight": (iq2, Q.IQ2_XXS)})
    with pytest.raises(UnsupportedModelError, match=r"'blk\.1\.attn_q\.weight' in .*iq2\.gguf has type IQ2_XXS"):
        engine(path)


def test_the_commands_refuse_a_bad_gguf_in_one_line_with_a_nonzero_exit(tiny, wide, tokenizer, tmp_path):
    """`loraplex serve` / `generate` on a truncated file, another architecture and an unsupported tensor type: exit
    status 1, the problem named, no traceback, nothing started."""
    whole = write_gguf(tmp_path / "whole.gguf", tiny, tokenizer)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    iq2 = np.zeros((256, 66), dtype=np.uint8)
    iq2_path = write_gguf(tmp_path / "iq2.gguf", wide, tokenizer, Q.Q8_0, raw={"blk.1.attn_q.weight": (iq2, Q.IQ2_XXS)})
    writer = GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    cases = [
        ("serve", cut, "truncated"),
        ("serve", iq2_path, "has type IQ2_XXS"),
        ("generate", tmp_path / "mamba.gguf", "'mamba'"),
    ]
    for command, path, problem in cases:
        args = ["--port", "0", "--database-url", f"sqlite:///{tmp_path / 'r.db'}"] if command == "serve" else []
        done = subprocess.run(
            [sys.executable, "-m", "loraplex.cli", command, "--model", str(path), *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 1, done.stderr
        assert problem in done.stderr and path.name in done.stderr and "Traceback" not in done.stderr, done.stderr
