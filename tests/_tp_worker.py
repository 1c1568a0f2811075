"""One rank of a tensor-parallel engine for tests/test_tensor_parallel.py (or the whole engine, run without the
rendezvous environment): `python tests/_tp_worker.py BUNDLE OUT.npz PROMPT_IDS DECODE_STEPS`.

Rank 0 (or the lone engine) warms up (which checks allocations on every rank), then runs one prompt in the first
slab: its prefill as one chunk, then DECODE_STEPS greedy decode steps, each under the allocation check on every
rank, and writes every step's logits row and the greedy ids to OUT.npz. The other ranks follow rank 0's steps.
"""
from __future__ import annotations

import os
import sys

import numpy as np


def main() -> int:
    from slabserve.runtime.engine import Engine
    from slabserve.runtime.ranks import RankGroup, rendezvous_env
    from slabserve.runtime.step import SeqChunk

    bundle, out = sys.argv[1], sys.argv[2]
    prompt = [int(t) for t in sys.argv[3].split(",")]
    steps = int(sys.argv[4])
    ranks = RankGroup.join(timeout_s=120) if rendezvous_env() is not None else None
    engine = Engine.from_plan(bundle, warm_up=False, ranks=ranks)
    if ranks is not None:
        ranks.ready(300)
        if not ranks.leads:
            ranks.follow(engine)
            ranks.close()
            return 0
    engine.warm_up()
    rows, ids = [], []
    slab_tokens = engine.config.classes[0].tokens

    def run(chunk: SeqChunk) -> np.ndarray:
        bucket = next(b for b in sorted(engine.inputs) if b >= len(chunk.token_ids))
        engine.inputs[bucket].fill([chunk])
        return engine._run_step(bucket)[0].numpy()  # (V,) a view of the arena

    logits = run(SeqChunk(0, 0, prompt, slab_tokens))
    rows.append(logits.copy())
    position = len(prompt)
    state = {"logits": logits}

    def decode() -> None:
        nonlocal position
        token = int(state["logits"].argmax())  # numpy: no tensor storage
        ids.append(token)
        state["logits"] = run(SeqChunk(0, position, [token], slab_tokens))
        position += 1

    for _ in range(steps):
        # every rank checks its own allocations over the same decode step (runtime.ranks: CHECK_BEGIN/END)
        engine._check_no_allocations(decode, 1, "a decode step", single_thread=False)
        rows.append(state["logits"].copy())
    np.savez(out, logits=np.stack(rows), ids=np.array(ids, dtype=np.int64))
    if ranks is not None:
        ranks.stop()
        ranks.close()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    sys.exit(main())
