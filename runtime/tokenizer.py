"""Tokenizer glue: text <-> token ids, chat templates, and streaming detokenization.

Contract:
- `Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust library does all the BPE work) and knows the few model
  facts the server needs: BOS (and whether the model wants it prepended), the EOS ids that stop generation, and
  the chat template. It loads from a Hugging Face tokenizer folder or from the metadata of a GGUF file.
- `encode` prepends BOS only when the model says so; the backend's post-processor is never used, so no EOS or
  other decoration is ever appended behind the caller's back.
- Chat templates are untrusted code: they render in jinja2's immutable sandbox with the globals Hugging Face
  templates expect. A template that rejects a conversation raises `ChatTemplateError` (a `ValueError`), which the
  server answers with INVALID_ARGUMENT.
- `IncrementalDetokenizer` turns a stream of generated ids into text pieces whose concatenation is exactly the
  decode of the whole stream, never emitting half a UTF-8 character, at O(1) decode work per token.

Every loading failure is an error that names the file it is about. This module knows nothing of torch.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import gguf
import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from slabserve.runtime.loader import read_gguf

__all__ = [
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "Tokenizer",
    "TokenizerFileError",
    "SUPPORTED_GGUF_TOKENIZER_MODELS",
    "SUPPORTED_GGUF_PRE_TOKENIZERS",
]

REPLACEMENT_CHAR = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole UTF-8 character

# GGUF token_type values (llama.cpp's llama_token_type).
_TOKEN_TYPE_UNKNOWN = 2
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


class TokenizerFileError(ValueError):
    """A tokenizer file exists but cannot be used; the message names the file."""


class ChatTemplateError(ValueError):
    """A conversation the chat template refuses, or messages of the wrong shape.

    `message_index` and `role` say which message, when one can be singled out.
    """

    def __init__(self, message: str, *, message_index: int | None = None, role: str | None = None):
        super().__init__(message)
        self.message_index = message_index
        self.role = role


# ---------------------------------------------------------------------------------------------------------------
# Pre-tokenizers for byte-level BPE GGUF files, keyed by `tokenizer.ggml.pre`. Each must split text exactly the way
# the vocabulary's merges were learned (the original tokenizer.json, and llama.cpp's `llama_vocab` regexes).
# ---------------------------------------------------------------------------------------------------------------

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_pre() -> pre_tokenizers.PreTokenizer:
    # llama.cpp isolates every \p{N} code point first, then runs the GPT-2 regex over the pieces; the original
    # SmolLM tokenizer.json is the same Sequence[Digits(individual), ByteLevel].
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )


def _split_then_bytes_pre(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    return build


# name -> (pre-tokenizer factory, ignore_merges). ignore_merges follows llama.cpp (and the original tokenizer.json
# of Llama 3): a pre-token that is itself in the vocabulary is taken whole.
_GPT2_PRE_TOKENIZERS: dict[str, tuple[Callable[[], pre_tokenizers.PreTokenizer], bool]] = {
    "default": (_gpt2_pre, False),
    "gpt2": (_gpt2_pre, False),
    "smollm": (_digits_then_gpt2_pre, False),
    "qwen2": (_split_then_bytes_pre(_QWEN2_SPLIT), False),
    "deepseek-r1-qwen": (_split_then_bytes_pre(_QWEN2_SPLIT), False),
    "llama-bpe": (_split_then_bytes_pre(_LLAMA3_SPLIT), True),
    "llama3": (_split_then_bytes_pre(_LLAMA3_SPLIT), True),
    "llama-v3": (_split_then_bytes_pre(_LLAMA3_SPLIT), True),
}

SUPPORTED_GGUF_TOKENIZER_MODELS = ("gpt2", "llama")
SUPPORTED_GGUF_PRE_TOKENIZERS = tuple(sorted(_GPT2_PRE_TOKENIZERS))


# ---------------------------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; Hugging Face templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_chat_template(source: str, origin: str) -> jinja2.Template:
    """Compile a template in the sandbox, with the environment Hugging Face's `apply_chat_template` uses."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise TokenizerFileError(f"chat template from {origin} does not compile: {exc} (line {exc.lineno})") from exc


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{index}] must be a dict, got {type(message).__name__}",
                                    message_index=index)
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{index}].role must be a non-empty string, got {role!r}",
                                    message_index=index)
        if not isinstance(message.get("content"), str):
            raise ChatTemplateError(f"messages[{index}].content must be a string", message_index=index, role=role)


# ---------------------------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------------------------


class Tokenizer:
    """Text <-> ids for one model, plus its chat template and stop ids. Build it with `from_hf_dir` or `from_gguf`."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos: bool,
        chat_template: str | None,
        template_tokens: Mapping[str, str] | None = None,
        origin: str = "<memory>",
    ):
        """`template_tokens` are the special token strings a chat template may read (bos_token, eos_token, ...)."""
        if add_bos and bos_token_id is None:
            raise TokenizerFileError(f"{origin}: the model asks for a BOS token but names none")
        self._backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self._add_bos = add_bos
        self._origin = origin
        self._chat_template_source = chat_template
        self._chat_template = _compile_chat_template(chat_template, origin) if chat_template else None
        self._template_tokens = dict(template_tokens or {})
        self._bos_text = backend.id_to_token(bos_token_id) if bos_token_id is not None else None
        # Only special added tokens are dropped by decode(skip_special_tokens=True).
        self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)

    # -- loading ------------------------------------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a Hugging Face tokenizer folder.

        Reads tokenizer.json (required), tokenizer_config.json (special tokens, add_bos_token, chat_template),
        chat_template.jinja (wins over the config's template) and generation_config.json (extra EOS ids).
        """
        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"tokenizer folder not found: {folder}")
        backend = _load_backend_json(folder / "tokenizer.json")
        config = _read_json_if_exists(folder / "tokenizer_config.json")
        generation = _read_json_if_exists(folder / "generation_config.json")

        tokens = {name: _token_content(config.get(name)) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        bos_token_id = _token_id(backend, tokens["bos_token"], folder / "tokenizer_config.json")
        if bos_token_id is None and isinstance(generation.get("bos_token_id"), int):
            bos_token_id = generation["bos_token_id"]
        eos_token_ids = _as_id_list(generation.get("eos_token_id"))
        eos_from_config = _token_id(backend, tokens["eos_token"], folder / "tokenizer_config.json")
        if eos_from_config is not None:
            eos_token_ids.append(eos_from_config)

        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"])
        else:  # no explicit flag: whatever the tokenizer.json post-processor does is what the model was trained with
            add_bos = bos_token_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos_token_id]

        return cls(
            backend,
            bos_token_id=bos_token_id,
            eos_token_ids=eos_token_ids,
            add_bos=add_bos,
            chat_template=_hf_chat_template(folder, config),
            template_tokens={k: v for k, v in tokens.items() if v is not None},
            origin=str(folder),
        )

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], reader: gguf.GGUFReader | None = None) -> Tokenizer:
        """Build the tokenizer a GGUF file describes in its `tokenizer.*` metadata.

        `reader` lets a caller that already opened the file (the weight loader) share it.
        """
        path = Path(path)
        if reader is None:
            if not path.is_file():
                raise FileNotFoundError(f"GGUF file not found: {path}")
            try:
                reader = read_gguf(path)
            except Exception as exc:  # the gguf package raises bare ValueError/struct errors on a bad file
                raise TokenizerFileError(f"{path} is not a readable GGUF file: {exc}") from exc
        meta = _GGUFMeta(reader, path)
        model_type = meta.get("tokenizer.ggml.model")
        builders = {"gpt2": _byte_level_bpe_from_gguf, "llama": _sentencepiece_bpe_from_gguf}
        if model_type not in builders:
            raise TokenizerFileError(
                f"{path}: tokenizer.ggml.model {model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_GGUF_TOKENIZER_MODELS)}"
            )
        backend = builders[model_type](meta)

        tokens = meta.require("tokenizer.ggml.tokens")
        names = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                 "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
        ids = {name: meta.get(f"tokenizer.ggml.{key}") for name, key in names.items()}
        # End-of-turn / end-of-message tokens stop generation too (llama.cpp's llama_vocab_is_eog).
        eos_token_ids = [
            i for i in (ids["eos_token"], meta.get("tokenizer.ggml.eot_token_id"), meta.get("tokenizer.ggml.eom_token_id"))
            if i is not None
        ]
        # llama.cpp and transformers both default to BOS for sentencepiece vocabularies and not for byte-level BPE.
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", model_type == "llama"))
        return cls(
            backend,
            bos_token_id=ids["bos_token"],
            eos_token_ids=eos_token_ids,
            add_bos=add_bos,
            chat_template=meta.get("tokenizer.chat_template"),
            template_tokens={name: tokens[i] for name, i in ids.items() if i is not None and 0 <= i < len(tokens)},
            origin=str(path),
        )

    # -- facts ----------------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation, the primary EOS first."""
        return self._eos_token_ids

    @property
    def add_bos(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` prepends BOS."""
        return self._add_bos

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that `decode(..., skip_special_tokens=True)` drops."""
        return self._special_ids

    @property
    def chat_template(self) -> str | None:
        return self._chat_template_source

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer` (read it, don't mutate it)."""
        return self._backend

    # -- text <-> ids ---------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special token strings in the text map to their ids. BOS only if the model wants it."""
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self._add_bos:
            return [self._bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    # -- chat -----------------------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """Render a conversation with the model's template. Raises ChatTemplateError for one it refuses."""
        if self._chat_template is None:
            raise ChatTemplateError(f"{self._origin} has no chat template; send a plain prompt instead")
        _check_messages(messages)
        try:
            return self._render(messages, add_generation_prompt)
        except jinja2.exceptions.SecurityError as exc:  # the template itself misbehaves, whatever the messages
            raise ChatTemplateError(f"chat template from {self._origin} broke the sandbox rules: {exc}") from exc
        except jinja2.exceptions.TemplateError as exc:
            raise self._explain_refusal(messages, exc) from exc

    def encode_chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Ids of the rendered conversation; BOS is prepended only if the model wants it and the template didn't."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        template_wrote_bos = self._bos_text is not None and text.startswith(self._bos_text)
        return self.encode(text, add_special_tokens=not template_wrote_bos)

    def validate_roles(self, messages: Sequence[Mapping[str, str]]) -> None:
        """Raise ChatTemplateError naming the first message (index and role) the template refuses.

        The roles a template knows are not cheaply derivable from its source (most accept any role; some raise for
        unknown ones or for a bad order), so this renders the conversation and asks the template itself.
        """
        self.apply_chat_template(messages, add_generation_prompt=True)

    def _render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> str:
        assert self._chat_template is not None
        plain = [dict(m) for m in messages]  # templates must not see (or mutate) the caller's objects
        return self._chat_template.render(
            messages=plain, add_generation_prompt=add_generation_prompt, **self._template_tokens
        )

    def _explain_refusal(self, messages: Sequence[Mapping[str, str]], exc: Exception) -> ChatTemplateError:
        # The first prefix of the conversation the template refuses points at the culprit. Templates that only
        # object to a whole conversation (say, one ending in an assistant turn) are blamed on the last message.
        culprit = len(messages) - 1
        for end in range(1, len(messages)):
            try:
                self._render(messages[:end], add_generation_prompt=True)
            except jinja2.exceptions.TemplateError:
                culprit = end - 1
                break
        if culprit < 0:
            return ChatTemplateError(f"the chat template refuses this conversation: {exc}")
        role = messages[culprit]["role"]
        return ChatTemplateError(
            f"messages[{culprit}].role {role!r}: the chat template refuses it: {exc}",
            message_index=culprit,
            role=role,
        )


# ---------------------------------------------------------------------------------------------------------------
# Loading helpers
# ---------------------------------------------------------------------------------------------------------------


def _load_backend_json(path: Path) -> tokenizers.Tokenizer:
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for bad JSON or an unknown model
        raise TokenizerFileError(f"{path} is not a valid tokenizer.json: {exc}") from exc


def _read_json_if_exists(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise TokenizerFileError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerFileError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(entry: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or an AddedToken dict."""
    if isinstance(entry, dict):
        entry = entry.get("content")
    return entry if isinstance(entry, str) else None


def _token_id(backend: tokenizers.Tokenizer, token: str | None, origin: Path) -> int | None:
    if token is None:
        return None
    token_id = backend.token_to_id(token)
    if token_id is None:
        raise TokenizerFileError(f"{origin}: special token {token!r} is not in the vocabulary")
    return token_id


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _hf_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class _GGUFMeta:
    """Typed access to a GGUF file's metadata fields, with errors that name the file and the key."""

    def __init__(self, reader: gguf.GGUFReader, path: Path):
        self._fields = reader.fields
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as exc:
            raise TokenizerFileError(f"{self.path}: metadata {key} is unreadable: {exc}") from exc

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise TokenizerFileError(f"{self.path}: metadata {key} is missing")
        return value


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, the alphabet byte-level BPE vocabularies are spelled in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _add_gguf_added_tokens(backend: tokenizers.Tokenizer, tokens: list[str], token_types: list[int],
                           usable: Callable[[str], bool]) -> None:
    """CONTROL tokens become special added tokens and USER_DEFINED ones plain added tokens, so text containing them
    maps to their ids whole (llama.cpp does the same). They are already in the vocabulary: no id changes."""
    special = [AddedToken(t, special=True, normalized=False)
               for t, k in zip(tokens, token_types) if k == _TOKEN_TYPE_CONTROL and usable(t)]
    user = [AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, token_types) if k == _TOKEN_TYPE_USER_DEFINED and usable(t)]
    if special:
        backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)


def _byte_level_bpe_from_gguf(meta: _GGUFMeta) -> tokenizers.Tokenizer:
    pre_name = meta.get("tokenizer.ggml.pre", "default")
    if pre_name not in _GPT2_PRE_TOKENIZERS:
        raise TokenizerFileError(
            f"{meta.path}: tokenizer.ggml.pre {pre_name!r} is not supported for byte-level BPE; "
            f"supported: {', '.join(SUPPORTED_GGUF_PRE_TOKENIZERS)}"
        )
    make_pre, ignore_merges = _GPT2_PRE_TOKENIZERS[pre_name]
    tokens = list(meta.require("tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in meta.require("tokenizer.ggml.merges")]
    token_types = list(meta.get("tokenizer.ggml.token_type") or [])

    # llama.cpp stores byte-level tokens already spelled in GPT-2's byte alphabet. A token that is not (a few
    # converters write added tokens raw) is respelled so the decoder maps it back to the same bytes.
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        spelled = token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(spelled, index)
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges)
    )
    backend.pre_tokenizer = make_pre()
    backend.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet would get a new id past the model's vocabulary: skip it.
    _add_gguf_added_tokens(backend, tokens, token_types, usable=lambda t: set(t) <= alphabet)
    return backend


def _sentencepiece_bpe_from_gguf(meta: _GGUFMeta) -> tokenizers.Tokenizer:
    """SentencePiece BPE (tokenizer.ggml.model 'llama'), rebuilt as transformers' LlamaTokenizer does."""
    tokens = list(meta.require("tokenizer.ggml.tokens"))
    token_types = list(meta.get("tokenizer.ggml.token_type") or [])
    vocab = {token: index for index, token in reversed(list(enumerate(tokens)))}  # first id wins on duplicates
    raw_merges = meta.get("tokenizer.ggml.merges")
    if raw_merges is not None:
        merges = [tuple(m.split(" ", 1)) for m in raw_merges]
    else:
        merges = _merges_from_scores(tokens, list(meta.require("tokenizer.ggml.scores")), vocab)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    if unk_id is None and _TOKEN_TYPE_UNKNOWN in token_types:
        unk_id = token_types.index(_TOKEN_TYPE_UNKNOWN)
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=tokens[unk_id] if unk_id is not None else None,
                   fuse_unk=True, byte_fallback=True)
    )
    add_prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    _add_gguf_added_tokens(backend, tokens, token_types, usable=lambda t: True)
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """SentencePiece files carry scores, not merges: every split of a token into two vocabulary pieces is a merge,
    ranked by the merged token's score (best first), ties broken by piece lengths then ids. This is the ordering
    transformers' `generate_merges` uses, so both tokenizers agree."""
    ranked = []
    for token, score in zip(tokens, scores):
        local = [
            (token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab
        ]
        local.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked.extend((score, left, right) for left, right in local)
    ranked.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in ranked]


# ---------------------------------------------------------------------------------------------------------------
# Streaming detokenization
# ---------------------------------------------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Turns generated ids, one at a time, into text pieces for streaming.

    Invariants:
    - Without `prompt_ids`, the concatenation of every `push` result and the final `flush` equals
      `tokenizer.decode(generated_ids, skip_special_tokens)`.
    - With `prompt_ids`, it equals the text the generated ids add after the prompt, which is what a client
      appending pieces to the prompt wants: for SentencePiece vocabularies the first generated word keeps its
      leading space (decode() of the generated ids alone drops it).
    - No piece ends inside a UTF-8 character: a U+FFFD only ever comes out where the full decode has one.

    How (vLLM's and TGI's prefix/read offsets): each push decodes only a short window of ids, starting a token or
    so before the unread ones so the decoder sees the left context (SentencePiece strips the space of the first
    token it decodes). The text of the window past what was already emitted is new. The window's trailing run of
    U+FFFD is held back, since it may be an incomplete character that the next token completes; the window slides
    forward whenever its text ends cleanly, so each push decodes O(1) tokens. Only a run of tokens that never
    forms a character (invalid bytes) keeps the window growing, and then only until a character arrives.

    One known gap, in SentencePiece byte-fallback vocabularies only: their decoder turns a whole run of <0xNN>
    tokens into U+FFFDs when any byte in the run is invalid or the run is cut short. If a stream ends (or breaks)
    inside such a run, decode() shows U+FFFD where the stream already sent the run's complete characters. Holding
    every byte run back until it ends would fix that at the cost of stalling CJK and emoji streams; we don't.
    """

    _PROMPT_CONTEXT_TOKENS = 6  # prompt tokens kept as left context: enough for any multi-token character

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._skipped_ids = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        prompt = list(prompt_ids or ())
        start = self._context_start(prompt, max(0, len(prompt) - self._PROMPT_CONTEXT_TOKENS))
        self._ids: list[int] = prompt[start:]  # the window: left context, then tokens not yet fully emitted
        self._read = len(self._ids)  # window index where the next slide starts the window
        # Characters of decode(window) already emitted (or part of the prompt). An incomplete character at the
        # prompt's end is not counted: the first generated token that completes it emits it.
        self._num_emitted_chars = len(self._decode(self._ids).rstrip(REPLACEMENT_CHAR))

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (often '', never half a character)."""
        self._ids.append(int(token_id))
        text = self._decode(self._ids)
        stable = len(text.rstrip(REPLACEMENT_CHAR))
        piece = text[self._num_emitted_chars:stable] if stable > self._num_emitted_chars else ""
        self._num_emitted_chars = max(self._num_emitted_chars, stable)
        if stable == len(text):
            self._slide()
        return piece

    def flush(self) -> str:
        """The text still held back (invalid or incomplete trailing bytes, as U+FFFD). Call once, at the end."""
        text = self._decode(self._ids)
        piece = text[self._num_emitted_chars:]
        self._num_emitted_chars = len(text)
        return piece

    def _slide(self) -> None:
        # Everything in the window is emitted and ends on a character boundary. Keep the tokens after the last
        # slide point as left context for the next token, and re-measure the emitted text of the new window.
        start = self._context_start(self._ids, self._read)
        self._ids = self._ids[start:]
        self._read = len(self._ids)
        self._num_emitted_chars = len(self._decode(self._ids))

    def _context_start(self, ids: list[int], start: int) -> int:
        # Skipped special tokens give no context: reach back past them to a token that decodes to something.
        while start > 0 and start < len(ids) and ids[start] in self._skipped_ids:
            start -= 1
        return start

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens) if ids else ""
