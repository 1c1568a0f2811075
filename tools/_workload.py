"""Workloads for the load generator: request classes, mixes read from YAML, and arrival schedules.

Contract: everything here is pure and deterministic given a seed; no gRPC, no clock. A schedule is a tuple of
`Arrival`s (offset from the run's start in seconds, request class, exact prompt and output lengths in tokens),
sorted by offset. The driver turns each into one Generate call at that offset, whatever happened before it.

A mix file (`--mix FILE`):

    name: ide
    classes:                     # at least one; shares are normalised to sum to 1
      - {name: completion, share: 0.7, prompt: [64, 512], output: [16, 64]}
      - {name: chat, share: 0.2, prompt: [128, 1024], output: [32, 256]}
      - {name: analysis, share: 0.1, prompt: [2048, 6144], output: [128, 256]}

Lengths are drawn uniformly from the closed ranges. Two built-in workloads give prompts a shape that repeats, as
real traffic does (name them with `--mix`, or add `shape:` and its parameters to a mix file):

  chat-sessions     multi-turn chat: conversations start at Poisson times; each has 2-5 turns, and every turn after
                    the first resends the whole history (the earlier messages and the answers the server gave) with a
                    new message, `think_s` seconds after the answer before it ended. Classes: `first-turn` (the
                    opening message, 64-512 tokens) and `next-turn` (16-128 new tokens); answers of 32-128 tokens.
                    The rate counts requests (turns): conversations start at rate / 3.5.
  repeated-context  completions over a few long file contexts: `contexts` contexts of 1,024-4,096 tokens, each
                    request one of them with a changed tail of 16-64 tokens, answers of 16-64. The contexts are
                    the workload's own (drawn from `context_seed`, not from a run's seed), so every step of a
                    sweep and every phase of a soak sends the same files, as one team's IDEs do all day.

A trace file (`--trace FILE`) is CSV with a header or JSON
lines, one arrival each: `offset_s` and `class` (a class of the mix), and optionally `prompt_tokens` and
`output_tokens` (drawn from the class when absent; a row with both may name a class the mix lacks).
"""
from __future__ import annotations

import csv
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml


class WorkloadError(ValueError):
    """A mix or trace file that cannot be used; the message names the file, the field and what is allowed."""


@dataclass(frozen=True, slots=True)
class RequestClass:
    name: str
    share: float
    prompt: tuple[int, int]   # prompt tokens, inclusive range
    output: tuple[int, int]   # output tokens (max_tokens, with EOS ignored), inclusive range

    @property
    def max_request_tokens(self) -> int:
        return self.prompt[1] + self.output[1]


@dataclass(frozen=True, slots=True)
class Mix:
    name: str
    classes: tuple[RequestClass, ...]
    shape: str = "independent"   # one of SHAPES: how prompts relate to each other
    think_s: float = 2.0         # chat-sessions: from an answer's end to the next turn
    turns: tuple[int, int] = (2, 5)  # chat-sessions: turns per conversation, inclusive
    contexts: int = 4            # repeated-context: distinct contexts in a run
    context_tokens: tuple[int, int] = (1024, 4096)  # repeated-context: their lengths
    context_seed: int = 0        # repeated-context: the contexts' lengths and token ids come from this seed

    def by_name(self, name: str) -> RequestClass:
        for c in self.classes:
            if c.name == name:
                return c
        raise WorkloadError(f"class {name!r} is not in mix {self.name!r} (classes: "
                            f"{', '.join(c.name for c in self.classes)})")


@dataclass(frozen=True, slots=True)
class Arrival:
    offset_s: float       # when to send, from the run's start (a later chat turn: after the turn before it)
    class_name: str
    prompt_tokens: int    # the whole prompt: with a context or a conversation's history included
    output_tokens: int
    session: int = -1     # chat-sessions: the conversation (turns of one are sent one after another)
    turn: int = 0         # chat-sessions: 0 for the opening message
    message_tokens: int = 0  # chat-sessions: the turn's new message (the rest of its prompt is history)
    context: int = -1     # repeated-context: which context the prompt starts with ...
    context_tokens: int = 0  # ... and its length (the rest of the prompt is the changed tail)
    context_seed: int = 0    # ... whose token ids are drawn from this seed


# The default "IDE mix": mostly short completions, chat turns, a minority of long analyses.
IDE_MIX = Mix("ide", (
    RequestClass("completion", 0.70, (64, 512), (16, 64)),
    RequestClass("chat", 0.20, (128, 1024), (32, 256)),
    RequestClass("analysis", 0.10, (2048, 6144), (128, 256)),
))
SHAPES = ("independent", "chat-sessions", "repeated-context")
# Multi-turn chat: shares are of conversations' turns (for largest_of_each_class); the schedule draws turns.
CHAT_SESSIONS = Mix("chat-sessions", (
    RequestClass("first-turn", 0.3, (64, 512), (32, 128)),
    RequestClass("next-turn", 0.7, (16, 128), (32, 128)),
), shape="chat-sessions")
# Repeated-context completion: the class's prompt range is the changed tail's; the context comes first.
REPEATED_CONTEXT = Mix("repeated-context", (RequestClass("edit", 1.0, (16, 64), (16, 64)),),
                       shape="repeated-context")
BUILT_IN = {m.name: m for m in (IDE_MIX, CHAT_SESSIONS, REPEATED_CONTEXT)}


def mix_named(name: str | None) -> Mix:
    """A built-in workload by name (ide, chat-sessions, repeated-context), else a mix YAML file; None: the IDE mix."""
    if name is None:
        return IDE_MIX
    return BUILT_IN[name] if name in BUILT_IN else load_mix(name)


def longest_prompt(mix: Mix) -> int:
    """The longest prompt + output a request of this workload can need."""
    if mix.shape == "repeated-context":
        return mix.context_tokens[1] + max(c.max_request_tokens for c in mix.classes)
    if mix.shape == "chat-sessions":
        first, nxt = mix.by_name("first-turn"), mix.by_name("next-turn")
        turns = mix.turns[1]
        return first.max_request_tokens + (turns - 1) * nxt.max_request_tokens
    return max(c.max_request_tokens for c in mix.classes)

_MIX_KEYS = {"name", "classes", "shape", "think_s", "turns", "contexts", "context_tokens", "context_seed"}
_CLASS_KEYS = {"name", "share", "prompt", "output"}


def load_mix(path: str | Path) -> Mix:
    """Read and validate a mix YAML file; an unknown key or a bad value is a WorkloadError naming it."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise WorkloadError(f"{path}: cannot read the mix: {err}") from None
    return mix_from_dict(data, str(path))


def mix_from_dict(data: object, where: str = "mix") -> Mix:
    if not isinstance(data, dict):
        raise WorkloadError(f"{where}: expected a mapping with keys {sorted(_MIX_KEYS)}")
    _no_unknown_keys(data, _MIX_KEYS, where)
    items = data.get("classes")
    if not isinstance(items, list) or not items:
        raise WorkloadError(f"{where}: classes: expected a non-empty list")
    classes = [_class_from_dict(item, f"{where}: classes[{i}]") for i, item in enumerate(items)]
    names = [c.name for c in classes]
    if len(set(names)) != len(names):
        raise WorkloadError(f"{where}: classes: names must be unique, got {names}")
    total = sum(c.share for c in classes)
    classes = [RequestClass(c.name, c.share / total, c.prompt, c.output) for c in classes]
    shape = data.get("shape", "independent")
    if shape not in SHAPES:
        raise WorkloadError(f"{where}: shape: {shape!r} is not allowed; expected one of {', '.join(SHAPES)}")
    if shape == "chat-sessions" and sorted(names) != ["first-turn", "next-turn"]:
        raise WorkloadError(f"{where}: shape chat-sessions needs exactly the classes first-turn and next-turn; "
                            f"got {names}")
    think = data.get("think_s", 2.0)
    if isinstance(think, bool) or not isinstance(think, (int, float)) or not think >= 0:
        raise WorkloadError(f"{where}: think_s: {think!r} is not allowed; expected seconds >= 0")
    contexts = data.get("contexts", 4)
    if isinstance(contexts, bool) or not isinstance(contexts, int) or contexts < 1:
        raise WorkloadError(f"{where}: contexts: {contexts!r} is not allowed; expected an integer >= 1")
    context_seed = data.get("context_seed", 0)
    if isinstance(context_seed, bool) or not isinstance(context_seed, int):
        raise WorkloadError(f"{where}: context_seed: {context_seed!r} is not allowed; expected an integer")
    return Mix(str(data.get("name", Path(where).stem)), tuple(classes), shape, float(think),
               _range(data.get("turns", [2, 5]), f"{where}: turns", 1), contexts,
               _range(data.get("context_tokens", [1024, 4096]), f"{where}: context_tokens", 1), context_seed)


def _class_from_dict(item: object, where: str) -> RequestClass:
    if not isinstance(item, dict):
        raise WorkloadError(f"{where}: expected a mapping with keys {sorted(_CLASS_KEYS)}")
    _no_unknown_keys(item, _CLASS_KEYS, where)
    missing = sorted(_CLASS_KEYS - item.keys())
    if missing:
        raise WorkloadError(f"{where}: missing {', '.join(missing)}")
    share = item["share"]
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not share > 0:
        raise WorkloadError(f"{where}: share: {share!r} is not allowed; expected a number > 0")
    return RequestClass(str(item["name"]), float(share), _range(item["prompt"], f"{where}: prompt", 1),
                        _range(item["output"], f"{where}: output", 1))


def _range(value: object, where: str, low: int) -> tuple[int, int]:
    ok = (isinstance(value, list) and len(value) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
          and low <= value[0] <= value[1])
    if not ok:
        raise WorkloadError(f"{where}: {value!r} is not allowed; expected [LOW, HIGH] integers with "
                            f"{low} <= LOW <= HIGH")
    return value[0], value[1]


def _no_unknown_keys(data: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise WorkloadError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})")


# ---- schedules --------------------------------------------------------------------------------------------------

def draw_lengths(cls: RequestClass, rng: random.Random) -> tuple[int, int]:
    return rng.randint(*cls.prompt), rng.randint(*cls.output)


def poisson_schedule(mix: Mix, rate: float, seed: int, *, duration_s: float | None = None,
                     num_requests: int | None = None) -> tuple[Arrival, ...]:
    """Poisson arrivals at `rate` per second until `duration_s` or `num_requests` (whichever is given)."""
    if not rate > 0:
        raise WorkloadError(f"rate: {rate!r} is not allowed; expected requests per second > 0")
    if (duration_s is None) == (num_requests is None):
        raise WorkloadError("give exactly one of a duration and a request count")
    if mix.shape == "chat-sessions":
        return _chat_sessions(mix, rate, seed, duration_s, num_requests)
    if mix.shape == "repeated-context":
        return _repeated_context(mix, rate, seed, duration_s, num_requests)
    rng = random.Random(seed)
    weights = [c.share for c in mix.classes]
    arrivals: list[Arrival] = []
    for t in _poisson_times(rng, rate, duration_s, num_requests, arrivals):
        cls = rng.choices(mix.classes, weights)[0]
        arrivals.append(Arrival(t, cls.name, *draw_lengths(cls, rng)))
    return tuple(arrivals)


def _poisson_times(rng: random.Random, rate: float, duration_s: float | None, num_requests: int | None,
                   made: list) -> Iterator[float]:
    """Poisson event times at `rate`, until `duration_s` or until `made` holds `num_requests` arrivals."""
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if (duration_s is not None and t >= duration_s) or (num_requests is not None and len(made) >= num_requests):
            return
        yield t


def _chat_sessions(mix: Mix, rate: float, seed: int, duration_s: float | None,
                   num_requests: int | None) -> tuple[Arrival, ...]:
    """Conversations starting at Poisson times (at rate / mean turns, so turns arrive at about `rate`), every turn
    with its whole history; a later turn's offset is nominal (the driver sends it `think_s` after the turn before
    it ends). Sessions are numbered from seed * 100_000, so schedules of different seeds never share one."""
    rng = random.Random(seed)
    first, nxt = mix.by_name("first-turn"), mix.by_name("next-turn")
    mean_turns = (mix.turns[0] + mix.turns[1]) / 2
    arrivals: list[Arrival] = []
    session = seed * 100_000
    for t in _poisson_times(rng, rate / mean_turns, duration_s, num_requests, arrivals):
        history = 0
        for turn in range(rng.randint(*mix.turns)):
            cls = first if turn == 0 else nxt
            message, output = draw_lengths(cls, rng)
            arrivals.append(Arrival(t + turn * mix.think_s, cls.name, history + message, output, session=session,
                                    turn=turn, message_tokens=message))
            history += message + output
        session += 1
    if num_requests is not None:
        arrivals = arrivals[:num_requests]
    return tuple(sorted(arrivals, key=lambda a: (a.offset_s, a.session, a.turn)))


def _repeated_context(mix: Mix, rate: float, seed: int, duration_s: float | None,
                      num_requests: int | None) -> tuple[Arrival, ...]:
    """Poisson arrivals, each one of the workload's `contexts` contexts (lengths and ids from its context_seed,
    whatever the run's seed) and a tail."""
    shared = random.Random(mix.context_seed)
    lengths = [shared.randint(*mix.context_tokens) for _ in range(mix.contexts)]
    rng = random.Random(seed)
    (cls,) = mix.classes
    arrivals: list[Arrival] = []
    for t in _poisson_times(rng, rate, duration_s, num_requests, arrivals):
        k = rng.randrange(mix.contexts)
        tail, output = draw_lengths(cls, rng)
        arrivals.append(Arrival(t, cls.name, lengths[k] + tail, output, context=k, context_tokens=lengths[k],
                                context_seed=mix.context_seed * 1_000 + k))
    return tuple(arrivals)


def largest_of_each_class(mix: Mix, gap_s: float = 1.0) -> tuple[Arrival, ...]:
    """One request of each class at its longest prompt and output, the longest first, `gap_s` apart from 0: a
    warm-up that opens with these has made the server handle the largest request the mix can send (the first
    such request sizes buffers that stay: the tokenizer's, gRPC's, the step's), whatever its Poisson draw gives."""
    if mix.shape != "independent":  # the longest request the workload can send, as a plain prompt
        (longest,) = sorted(mix.classes, key=lambda c: -c.output[1])[:1]
        return (Arrival(0.0, longest.name, longest_prompt(mix) - longest.output[1], longest.output[1]),)
    ordered = sorted(mix.classes, key=lambda c: -c.max_request_tokens)
    return tuple(Arrival(i * gap_s, c.name, c.prompt[1], c.output[1]) for i, c in enumerate(ordered))


def load_trace(path: str | Path, mix: Mix, seed: int) -> tuple[Arrival, ...]:
    """Arrivals from a CSV (with a header) or JSON-lines file; lengths absent from a row are drawn from its class."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise WorkloadError(f"{path}: cannot read the trace: {err.strerror or err}") from None
    rows = _trace_rows(text, path)
    rng = random.Random(seed)
    arrivals = [_arrival_from_row(row, mix, rng, f"{path}: row {i + 1}") for i, row in enumerate(rows)]
    if not arrivals:
        raise WorkloadError(f"{path}: the trace has no arrivals")
    return tuple(sorted(arrivals, key=lambda a: a.offset_s))


def _trace_rows(text: str, path: Path) -> list[dict]:
    lines = [line for line in text.splitlines() if line.strip()]
    if lines and lines[0].lstrip().startswith("{"):
        try:
            return [json.loads(line) for line in lines]
        except json.JSONDecodeError as err:
            raise WorkloadError(f"{path}: not JSON lines: {err}") from None
    return list(csv.DictReader(lines))


def _arrival_from_row(row: dict, mix: Mix, rng: random.Random, where: str) -> Arrival:
    if "offset_s" not in row or "class" not in row:
        raise WorkloadError(f"{where}: needs offset_s and class (got {sorted(row)})")
    try:
        offset = float(row["offset_s"])
    except (TypeError, ValueError):
        raise WorkloadError(f"{where}: offset_s: {row['offset_s']!r} is not a number") from None
    if not offset >= 0:
        raise WorkloadError(f"{where}: offset_s: {offset!r} is not allowed; expected seconds >= 0")
    name = str(row["class"])
    given = (row.get("prompt_tokens"), row.get("output_tokens"))
    if all(v not in (None, "") for v in given):  # a row with both lengths needs no class of the mix
        prompt, output = (_optional_int(v, 0, f"{where}: {k}") for v, k in zip(given, ("prompt_tokens",
                                                                                       "output_tokens")))
        return Arrival(offset, name, prompt, output)
    prompt, output = draw_lengths(mix.by_name(name), rng)
    prompt = _optional_int(given[0], prompt, f"{where}: prompt_tokens")
    output = _optional_int(given[1], output, f"{where}: output_tokens")
    return Arrival(offset, name, prompt, output)


def _optional_int(value: object, default: int, where: str) -> int:
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise WorkloadError(f"{where}: {value!r} is not an integer") from None
    if number < 1:
        raise WorkloadError(f"{where}: {number} is not allowed; expected >= 1")
    return number


def prompt_ids(num_tokens: int, vocab_size: int, rng: random.Random) -> list[int]:
    """`num_tokens` token ids drawn uniformly from the vocabulary, skipping its first ids (usually special tokens,
    which some models treat as end of text even in a prompt)."""
    low = min(64, vocab_size // 4)
    return [rng.randrange(low, vocab_size) for _ in range(num_tokens)]
