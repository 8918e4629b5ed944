"""IncrementalDetokenizer: streamed deltas add up to decode(), multi-byte characters, stop strings, flush."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from bench.tokenizer import train_tokenizer
from engine.detokenizer import IncrementalDetokenizer, rust_decoder

PIECES = ["東京", "🙂", "café", " ", "the ", "Alice", "\n", "naïve", "ß", "ok."]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return train_tokenizer()


def stream(detok: IncrementalDetokenizer, token_ids: list[int], chunks: list[int] | None = None) -> list[str]:
    """Pushes token_ids in chunks of the given sizes (default 1) and flushes; returns every delta."""
    deltas, start = [], 0
    for size in chunks or [1] * len(token_ids):
        deltas.append(detok.push(token_ids[start : start + size]))
        start += size
    assert start >= len(token_ids)
    deltas.append(detok.flush())
    return deltas


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_random_token_ids_stream_to_decode(tokenizer):
    """Any ids, including specials and byte tokens that leave characters unfinished or invalid."""
    rng = random.Random(0)
    prompts = ["", "hello 東京", "<s>user: café 🙂\n<s>assistant: "]
    for _ in range(400):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 25))]
        skip = rng.random() < 0.5
        stop = rng.choice([(), ("\x00never\x00",)])  # a stop string that holds text back but never matches
        prompt_ids = encode(tokenizer, rng.choice(prompts))
        detok = IncrementalDetokenizer(tokenizer, stop, skip_special_tokens=skip, prompt_token_ids=prompt_ids)
        chunks = [rng.randint(1, 3) for _ in ids]
        expected = tokenizer.decode(ids, skip_special_tokens=skip)
        assert "".join(stream(detok, ids, chunks)) == expected
        assert detok.text == expected and not detok.stopped


def window_path(detok: IncrementalDetokenizer) -> IncrementalDetokenizer:
    detok._stream = None  # decode windows through transformers, as for a tokenizer DecodeStream does not fit
    return detok


def test_the_rust_stream_gives_the_window_paths_deltas(tokenizer):
    """DecodeStream (the fast path) against the windows decoded through transformers, on random ids after random
    prompts (which may end inside a character), with and without stop strings: the same delta at every push of one
    token (a decode step's), the same text when pushes carry several (the stream may release some of it sooner)."""
    assert rust_decoder(tokenizer) is tokenizer.backend_tokenizer
    rng = random.Random(2)
    streamed_prompts = 0
    for _ in range(400):
        prompt_ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 8))]
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 25))]
        skip = rng.random() < 0.5
        stop = rng.choice([(), ("\x00never\x00",), ("e",), ("th",)])
        chunks = [rng.randint(1, 3) for _ in ids] if rng.random() < 0.5 else [1] * len(ids)
        fast = IncrementalDetokenizer(tokenizer, stop, skip_special_tokens=skip, prompt_token_ids=prompt_ids)
        slow = window_path(
            IncrementalDetokenizer(tokenizer, stop, skip_special_tokens=skip, prompt_token_ids=prompt_ids)
        )
        streamed_prompts += fast._stream is not None and bool(prompt_ids)
        fast_deltas, slow_deltas = stream(fast, ids, chunks), stream(slow, ids, chunks)
        assert fast_deltas == slow_deltas if set(chunks) == {1} else "".join(fast_deltas) == "".join(slow_deltas)
        assert (fast.text, fast.stopped, fast.stop_string) == (slow.text, slow.stopped, slow.stop_string)
    assert streamed_prompts > 200  # most took the fast path (a prompt window ending mid-character does not)


def test_tokenizers_whose_decode_differs_keep_the_window_path(tokenizer):
    cleaned = train_tokenizer()
    cleaned.clean_up_tokenization_spaces = True  # transformers edits the text after the Rust decode
    assert rust_decoder(cleaned) is None and IncrementalDetokenizer(cleaned)._stream is None

    class OwnDecode(PreTrainedTokenizerFast):
        def decode(self, *args, **kwargs):
            return super().decode(*args, **kwargs).upper()

    own = OwnDecode(tokenizer_object=tokenizer.backend_tokenizer)
    assert rust_decoder(own) is None and rust_decoder(object()) is None
    ids = encode(tokenizer, "hello world")
    assert "".join(stream(IncrementalDetokenizer(own), ids)) == "HELLO WORLD"


def test_multibyte_text_streams_whole_characters(tokenizer):
    rng = random.Random(1)
    held_back = 0
    for _ in range(100):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randrange(1, 12)))
        ids = encode(tokenizer, text)
        deltas = stream(IncrementalDetokenizer(tokenizer), ids)
        assert "".join(deltas) == text == tokenizer.decode(ids)
        assert not any("\ufffd" in d for d in deltas)  # never half a character
        held_back += deltas[:-1].count("")
    assert held_back > 0  # the pieces do split characters over tokens


def test_decodes_a_window_not_the_whole_output(tokenizer):
    calls: list[int] = []

    class Spy:
        def decode(self, ids, **kwargs):
            calls.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    ids = encode(tokenizer, "Alice was beginning to get very tired of sitting by her sister " * 8)
    assert "".join(stream(IncrementalDetokenizer(Spy()), ids)) == tokenizer.decode(ids)
    assert len(ids) > 100 and max(calls) <= 4


def test_prompt_context_keeps_the_first_leading_space():
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁again": 3}
    sentencepiece_like = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    sentencepiece_like.pre_tokenizer = pre_tokenizers.Metaspace()
    sentencepiece_like.decoder = decoders.Metaspace()  # drops the space at the start of a decode
    tok = PreTrainedTokenizerFast(tokenizer_object=sentencepiece_like, unk_token="<unk>")
    assert tok.decode([2]) == "world"
    assert stream(IncrementalDetokenizer(tok, prompt_token_ids=[1]), [2, 3]) == [" world", " again", ""]
    assert "".join(stream(IncrementalDetokenizer(tok), [2, 3])) == "world again"


@pytest.mark.parametrize(
    ("text", "stop", "before"),
    [
        ("The cat sat on the mat. More text", "sat on the", "The cat "),
        ("Alice said 東京 🙂 and left", "東京 🙂", "Alice said "),
        ("one two three", "two three four", None),  # partly there, never whole: no stop
    ],
)
def test_stop_string_spanning_tokens_is_cut_and_never_leaked(tokenizer, text, stop, before):
    ids = encode(tokenizer, text)
    assert not any(stop in tokenizer.decode([i]) for i in ids)  # it does span tokens
    detok = IncrementalDetokenizer(tokenizer, stop=["zzz", stop])
    deltas = stream(detok, ids)
    # deltas cannot be taken back, so "exactly the text before the stop" means no part of it leaked
    assert "".join(deltas) == detok.text == (text if before is None else before)
    assert detok.stopped == (before is not None)
    if before is not None:
        assert detok.stop_string == stop
        assert detok.push(encode(tokenizer, " after")) == "" and detok.flush() == ""


def test_stop_at_the_very_beginning(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=["Hello"], prompt_token_ids=encode(tokenizer, "say: "))
    deltas = stream(detok, encode(tokenizer, "Hello there, how are you"))
    assert set(deltas) == {""} and detok.text == "" and detok.stopped


def test_earliest_stop_string_wins(tokenizer):
    ids = encode(tokenizer, "hello world")
    detok = IncrementalDetokenizer(tokenizer, stop=["world", "lo w"])
    assert "".join(stream(detok, ids, chunks=[len(ids)])) == "hel"  # both complete in the same push
    assert detok.stop_string == "lo w"


def test_flush_releases_the_held_back_tail(tokenizer):
    ids = encode(tokenizer, "the rabbit ran 東京")
    detok = IncrementalDetokenizer(tokenizer, stop=["NEVERMATCHES"])
    streamed = "".join(detok.push([i]) for i in ids)
    assert len(streamed) == len("the rabbit ran 東京") - (len("NEVERMATCHES") - 1)
    assert streamed + detok.flush() == "the rabbit ran 東京" == detok.text
    # an output cut mid-character: flush gives what decode() gives
    cut = encode(tokenizer, "ok 🙂")[:-1]
    detok = IncrementalDetokenizer(tokenizer)
    streamed = "".join(detok.push([i]) for i in cut)
    assert streamed == tokenizer.decode(cut).rstrip("\ufffd") and streamed.rstrip() == "ok"  # the partial 🙂 held
    assert streamed + detok.flush() == tokenizer.decode(cut)
