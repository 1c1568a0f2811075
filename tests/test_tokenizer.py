"""runtime/tokenizer.py: GGUF and HF-folder loading checked against transformers, chat templates, streaming
detokenization invariants, and the errors a bad file or a refused conversation gives."""

from __future__ import annotations

import json
import random

import pytest
from _tok_fixtures import (
    bundled_gguf_path,
    load_transformers_gguf_tokenizer,
    write_tiny_byte_level_gguf,
    write_tiny_spm_gguf,
)
from tokenizers import pre_tokenizers, processors

from slabserve.runtime.tokenizer import (
                                         ChatTemplateError,
                                         IncrementalDetokenizer,
                                         Tokenizer,
                                         TokenizerFileError,
                                         )

FFFD = "\ufffd"

# Strings on which transformers' GGUF tokenizer and the original SmolLM tokenizer agree.
AGREED_STRINGS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { sum += a[i]; }",
    "1234567890",
    "pi=3.14159, e=2.71828; 1,000,000 and v1.2.3",
    "He said: \"it's 42\" and she'll say 'no'.",
    "naïve café, déjà vu, Straße, Ελληνικά, русский",
    "東京は晴れです。北京欢迎你！안녕하세요",
    "emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "tabs\tand\tnewlines\n\n\nand\r\nwindows",
    "trailing spaces   ",
    "    leading spaces",
    "a  b   c    d",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|im_end|><file_sep><jupyter_code>x",
    "mixed<|im_start|>markup<|im_end|>inline",
    "https://example.com/path?q=a&b=c#frag",
    "x²+y²=z²,½¼¾,١٢٣,①②③,Ⅻ",
    "",
    " ",
    "\u00a0nbsp\u200bzwsp\ufeffbom",
    "```python\nprint('hi')\n```",
]

# Whitespace runs before numbers: here the original tokenizer (Digits(individual) then ByteLevel, as llama.cpp's
# 'smollm' pre-tokenizer) and transformers' GGUF conversion (ByteLevel alone) split differently. We follow the
# original, which is what the model was trained on.
DIGIT_AFTER_SPACES = [
    "  1", "x  12", "a\n\n3", "   42  ", "total:\t\t99", "line\n\n\n2024", "x² = z², ½ ¼ ¾, ١٢٣, ①②③, Ⅻ",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "Seven."},
        {"role": "user", "content": "Another, in 東京 style 😀"},
    ],
    [{"role": "user", "content": "code:\n```py\nx = 1\n```"}, {"role": "assistant", "content": "ok"}],
]


@pytest.fixture(scope="module")
def gguf_path():
    path = bundled_gguf_path()
    if not path.is_file():
        pytest.skip(f"bundled model not installed: {path}")
    return path


@pytest.fixture(scope="module")
def tok(gguf_path):
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def ref(gguf_path):
    return load_transformers_gguf_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    return Tokenizer.from_gguf(write_tiny_spm_gguf(path))


# -- (a) the GGUF tokenizer against transformers ------------------------------------------------------------------


def test_gguf_facts(tok):
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == (2,)
    assert tok.add_bos is False
    assert tok.special_token_ids == frozenset(range(17))


@pytest.mark.parametrize("text", AGREED_STRINGS)
def test_gguf_ids_match_transformers(tok, ref, text):
    ids = tok.encode(text)
    assert ids == ref(text).input_ids
    assert tok.decode(ids) == ref.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", DIGIT_AFTER_SPACES)
def test_gguf_splits_every_digit_like_the_original_tokenizer(tok, ref, text):
    # The reference is transformers' tokenizer with the original SmolLM pre-tokenizer put back.
    original = ref.backend_tokenizer.__class__.from_str(ref.backend_tokenizer.to_str())
    original.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    ids = tok.encode(text)
    assert ids == original.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text
    # llama.cpp's rule, independently: a token holding a number character holds nothing else.
    for piece in (tok.decode([i]) for i in ids):
        assert not any(c.isnumeric() for c in piece) or len(piece) == 1, piece


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(tok, ref, messages):
    for add_generation_prompt in (True, False):
        text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    expected = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert tok.encode_chat(messages) == expected


def test_other_byte_level_pre_tokenizers_match_transformers(tmp_path):
    texts = AGREED_STRINGS[:14] + ["It'S WE'LL 12345 東京\r\n\r\n  x"]
    for pre in ("gpt2", "qwen2", "llama-bpe", None):
        path = write_tiny_byte_level_gguf(tmp_path / f"{pre}.gguf", pre)
        ours, theirs = Tokenizer.from_gguf(path), load_transformers_gguf_tokenizer(path)
        for text in texts:
            assert ours.encode(text) == theirs(text).input_ids, (pre, text)


def test_sentencepiece_gguf_matches_transformers(tmp_path, spm):
    theirs = load_transformers_gguf_tokenizer(write_tiny_spm_gguf(tmp_path / "spm.gguf"))
    assert spm.add_bos is True
    for text in ["hello world", " hello  world", "the cat is in the sun", "Hello World", "日本 😀", "\n\tx", "",
                 "<s>hello</s>", "    and   is"]:
        ids = spm.encode(text)
        assert ids == theirs(text).input_ids, text
        assert spm.decode(ids) == theirs.decode(ids), text


# -- (b) incremental detokenization ---------------------------------------------------------------------------------


def stream(tokenizer, ids, prompt_ids=None, skip_special_tokens=False):
    det = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids, skip_special_tokens=skip_special_tokens)
    pieces = [det.push(i) for i in ids]
    return pieces, det.flush()


def assert_stream_is_exact(tokenizer, ids, skip_special_tokens=False):
    """Concatenation equals the full decode, and text once emitted is never contradicted by a later decode."""
    det = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    emitted = ""
    for n, token_id in enumerate(ids, start=1):
        emitted += det.push(token_id)
        assert tokenizer.decode(ids[:n], skip_special_tokens=skip_special_tokens).startswith(emitted)
    emitted += det.flush()
    assert emitted == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def fragments(tok):
    """Ids of tokens that are a fragment of a UTF-8 character (their lone decode is U+FFFD)."""
    return [i for i in range(tok.vocab_size) if FFFD in tok.decode([i])]


def test_stream_of_valid_text_never_emits_half_a_character(tok):
    text = "".join(AGREED_STRINGS) + "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🧑🏿‍🚀 ǅ ﷺ 𒀀"
    ids = tok.encode(text)
    pieces, tail = stream(tok, ids)
    assert all(FFFD not in p for p in pieces) and tail == ""
    assert "".join(pieces) == text


def test_stream_of_random_ids_is_exact(tok, fragments):
    rng = random.Random(1234)
    assert len(fragments) > 100  # the vocabulary does hold lone bytes of multi-byte characters
    specials = sorted(tok.special_token_ids)
    for trial in range(40):
        pool = [rng.randrange(tok.vocab_size) for _ in range(30)] + rng.sample(fragments, 30) + specials
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 60))]
        assert_stream_is_exact(tok, ids, skip_special_tokens=trial % 2 == 1)


def test_stream_of_character_fragments_is_exact(tok, fragments):
    # Emoji and CJK split into single-byte tokens, shuffled and cut short: completes, breaks and garbage.
    rng = random.Random(99)
    ascii_ids = [tok.encode(chr(c)) for c in range(0x20, 0x7F)]
    text_ids = tok.encode("😀東京👍🏽ß€𝔘")
    for _ in range(30):
        ids = text_ids[: rng.randint(0, len(text_ids))]
        ids += rng.sample(fragments, 5) + rng.choice(ascii_ids) + text_ids[rng.randint(0, 5):]
        assert_stream_is_exact(tok, ids)


def test_stream_decodes_a_small_window_per_token(tok, monkeypatch):
    ids = tok.encode(" ".join(AGREED_STRINGS) * 8)
    assert len(ids) > 1500
    widest = []
    decode = tok.decode

    def spy(window, skip_special_tokens=False):
        widest.append(len(window))
        return decode(window, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(tok, "decode", spy)
    pieces, tail = stream(tok, ids)
    monkeypatch.undo()
    assert "".join(pieces) + tail == tok.decode(ids)
    assert max(widest) <= 8  # a character is at most 4 bytes: the window never needs more than a few tokens
    assert len(widest) <= 2 * len(ids) + 2


def test_stream_after_prompt_continues_the_prompt_text(tok):
    prompt = tok.encode("<|im_start|>assistant\nSure: 😀")
    gen = tok.encode(" 東京 and 42 more")
    pieces, tail = stream(tok, gen, prompt_ids=prompt)
    assert "".join(pieces) + tail == tok.decode(gen)
    # A prompt that ends inside a character: the first generated token that completes it emits it whole.
    cut = prompt[:-1]
    rest = prompt[-1:] + gen
    pieces, tail = stream(tok, rest, prompt_ids=cut)
    assert FFFD in tok.decode(cut) and FFFD not in "".join(pieces)
    assert "".join(pieces) + tail == tok.decode(cut + rest)[len(tok.decode(cut).rstrip(FFFD)):]


def test_stream_keeps_sentencepiece_leading_spaces(spm):
    prompt = spm.encode("the cat")
    gen = spm.encode(" is in  the sun 日本", add_special_tokens=False)
    pieces, tail = stream(spm, gen, prompt_ids=prompt)
    # After a prompt, the first word keeps its space: the text appends to the prompt's.
    assert "".join(pieces) + tail == " is in  the sun 日本" == spm.decode(prompt + gen)[len(spm.decode(prompt)):]
    assert all(FFFD not in p for p in pieces)
    # Without one, it matches decode() of the generated ids, which drops the first word's space.
    pieces, tail = stream(spm, gen)
    assert "".join(pieces) + tail == spm.decode(gen) == "is in  the sun 日本"
    # Skipped special tokens in the stream don't eat the space of the word after them.
    with_eos = gen[:3] + [spm.eos_token_ids[0]] + gen[3:]
    pieces, tail = stream(spm, with_eos, prompt_ids=prompt, skip_special_tokens=True)
    assert "".join(pieces) + tail == " is in  the sun 日本"


def test_stream_of_sentencepiece_byte_tokens(spm):
    rng = random.Random(7)
    words = [spm.encode(w, add_special_tokens=False) for w in [" hello", " world", " 日本", " 😀", " ß€", "\n"]]
    for _ in range(20):
        ids = [i for _ in range(rng.randint(1, 12)) for i in rng.choice(words)]
        pieces, tail = stream(spm, ids)
        assert all(FFFD not in p for p in pieces) and tail == ""
        assert "".join(pieces) == spm.decode(ids)


# -- (c) a Hugging Face tokenizer folder -----------------------------------------------------------------------------


def test_from_hf_dir_matches_the_gguf_tokenizer(tok, ref, tmp_path):
    ref.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 0]}))
    hf = Tokenizer.from_hf_dir(tmp_path)
    assert (hf.vocab_size, hf.bos_token_id, hf.add_bos) == (49152, 1, False)
    assert hf.eos_token_ids == (2, 0)
    for text in AGREED_STRINGS:
        assert hf.encode(text) == tok.encode(text), text
    for messages in CONVERSATIONS:
        assert hf.apply_chat_template(messages) == tok.apply_chat_template(messages)
    # The saved tokenizer.json carries transformers' pre-tokenizer, so it also matches transformers there.
    for text in DIGIT_AFTER_SPACES:
        assert hf.encode(text) == ref(text).input_ids


def test_from_hf_dir_reads_template_and_bos_from_config(tmp_path, spm):
    spm.backend.save(str(tmp_path / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "add_bos_token": True, "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = Tokenizer.from_hf_dir(tmp_path)
    assert (hf.bos_token_id, hf.eos_token_ids, hf.add_bos) == (1, (2,), True)
    assert hf.encode("hello") == spm.encode("hello")
    messages = [{"role": "user", "content": "hello"}]
    assert hf.apply_chat_template(messages) == "<s>[user] hello"
    assert hf.encode_chat(messages).count(1) == 1  # the template wrote BOS: no second one


def test_from_hf_dir_without_add_bos_flag_follows_the_post_processor(tmp_path, spm):
    backend = spm.backend.__class__.from_str(spm.backend.to_str())
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    hf = Tokenizer.from_hf_dir(tmp_path)
    assert hf.add_bos is True
    assert hf.encode("hello") == [1, *hf.encode("hello", add_special_tokens=False)] == spm.encode("hello")


# -- (d) errors ------------------------------------------------------------------------------------------------------


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        Tokenizer.from_gguf(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="tokenizer folder not found"):
        Tokenizer.from_hf_dir(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_hf_dir(tmp_path)


@pytest.mark.parametrize("content", ["{not json", '{"model": {"type": "Nonsense"}}', ""])
def test_corrupt_tokenizer_json_is_named(tmp_path, content):
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(TokenizerFileError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_hf_dir(tmp_path)


def test_corrupt_config_and_gguf_are_named(tmp_path, spm):
    spm.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(TokenizerFileError, match="tokenizer_config.json"):
        Tokenizer.from_hf_dir(tmp_path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(TokenizerFileError, match="bad.gguf"):
        Tokenizer.from_gguf(bad)


def test_unsupported_gguf_tokenizer_is_named(tmp_path):
    with pytest.raises(TokenizerFileError, match=r"'bert'.*supported: gpt2, llama"):
        Tokenizer.from_gguf(write_tiny_byte_level_gguf(tmp_path / "bert.gguf", "default", model="bert"))
    with pytest.raises(TokenizerFileError, match=r"tokenizer.ggml.pre 'mystery'.*smollm"):
        Tokenizer.from_gguf(write_tiny_byte_level_gguf(tmp_path / "pre.gguf", "mystery"))


def test_unknown_role_is_refused_by_name(tmp_path):
    template = (
        "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}<{{ m['role'] }}>{{ m['content'] }}"
        "{% endfor %}"
    )
    strict = Tokenizer.from_gguf(write_tiny_spm_gguf(tmp_path / "strict.gguf", chat_template=template))
    messages = [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}, {"role": "user", "content": "y"}]
    with pytest.raises(ChatTemplateError, match=r"messages\[1\]\.role 'wizard'.*Unknown role: wizard") as info:
        strict.validate_roles(messages)
    assert (info.value.message_index, info.value.role) == (1, "wizard")
    with pytest.raises(ValueError, match="wizard"):
        strict.encode_chat(messages)
    strict.validate_roles([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])


def test_malformed_messages_are_refused(tok):
    for messages, field in [
        ([{"content": "no role"}], r"messages\[0\]\.role"),
        ([{"role": "user", "content": "ok"}, {"role": "user"}], r"messages\[1\]\.content"),
        (["user: hi"], r"messages\[0\] must be a dict"),
        ("hi", "messages must be a list"),
    ]:
        with pytest.raises(ChatTemplateError, match=field):
            tok.apply_chat_template(messages)
    tok.validate_roles([{"role": "tool", "content": "ChatML accepts any role"}])


def test_template_cannot_escape_the_sandbox(tmp_path):
    template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    evil = Tokenizer.from_gguf(write_tiny_spm_gguf(tmp_path / "evil.gguf", chat_template=template))
    with pytest.raises(ChatTemplateError):
        evil.apply_chat_template([{"role": "user", "content": "x"}])
