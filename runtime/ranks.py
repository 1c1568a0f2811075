"""Serving a tensor-parallel plan: one process per rank on torch.distributed, rank 0 leading.

How the ranks run (DESIGN.md, "Tensor-parallel plans"):

- Every rank is a process with the standard rendezvous environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
  MASTER_PORT), so `torchrun --nproc-per-node N -m slabserve.runtime.serve_cli DIR` works; `slabserve serve DIR`
  with a tensor-parallel plan starts the N processes itself (`launch`). The group is gloo on CPU and NCCL on CUDA,
  with its collective timeout set (`--collective-timeout`).
- Every rank builds the same engine from the plan, holding its slice of the weights and its KV heads
  (runtime/tensor_parallel.py). Rank 0 owns admission, the scheduler, the sampler and the front doors. Before each
  step it sends the step's inputs to the others in one broadcast of a planned buffer (`RankGroup.message`: a header
  and the bucket's step inputs, the plan's staging.collective_bytes); each follower copies them into its own step
  inputs and runs the same bucketed step, whose two all-reduces per layer meet rank 0's. Copies of retained KV rows
  between slabs go the same way, so every rank's KV heads hold the same rows. On CUDA every rank captures its graphs
  when rank 0 does (CAPTURE): the eager runs before each capture meet in the same order, and afterwards each step's
  collectives are NCCL calls inside every rank's graph replay.
- Zero allocations on every rank: rank 0's warm-up brackets its checked steps with CHECK_BEGIN and CHECK_END; each
  follower watches its own steps between the two (runtime.executor.AllocationWatch) and reports its count in an
  all-reduce; a rank that allocated refuses the plan, named.
- Faults. While idle, rank 0 sends a PING every PING_S that every rank answers in an all-reduce, so a rank that died
  or hangs is found within the collective timeout even with no traffic. Every rank's watchdog thread records its
  progress in the rendezvous store each second; when a collective fails, rank 0 names the ranks that stopped
  answering (`RankGroup.diagnose`), turns health NOT_SERVING, and exits; followers exit when the group breaks; the
  launcher takes the rest down and leaves no orphan. SIGTERM to the launcher (or to rank 0) drains as on one device,
  then rank 0 sends STOP and every rank exits 0.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch

from slabserve.kernels import collectives
from slabserve.runtime.step import STEP_INPUT_DTYPES, step_input_shapes

log = logging.getLogger("slabserve.ranks")

HEADER = 8  # op, message number, then up to 6 operands
OP_STEP, OP_COPY, OP_PING, OP_CHECK_BEGIN, OP_CHECK_END, OP_STOP, OP_CAPTURE = 1, 2, 3, 4, 5, 6, 7
OP_NAMES = {OP_STEP: "step", OP_COPY: "copy", OP_PING: "ping", OP_CHECK_BEGIN: "check_begin",
            OP_CHECK_END: "check_end", OP_STOP: "stop", OP_CAPTURE: "capture"}
PING_S = 1.0  # rank 0 pings an idle group this often
DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0
WATCHDOG_S = 1.0
_STORE_PREFIX = "slabserve/alive/"


def message_numel(buckets: Sequence[int], max_seqs: int) -> int:
    """int64 elements of the step message: the header and the largest bucket's step inputs."""
    return HEADER + max(sum(step_input_shapes(t, max_seqs).values()) for t in buckets)


def collective_bytes(buckets: Sequence[int], max_seqs: int, degree: int) -> int:
    """Bytes each rank holds for the group (the plan's staging.collective_bytes): the step message, the per-rank
    allocation counts and the ping's answer; 0 on one device."""
    if degree == 1:
        return 0
    return 8 * (message_numel(buckets, max_seqs) + degree + 1)


def rendezvous_env() -> dict[str, str] | None:
    """The torch.distributed rendezvous environment of this process when it is one rank of a group, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return {k: os.environ.get(k, "") for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return None


class GroupFailed(RuntimeError):
    """A collective of the tensor-parallel group failed: a rank died, hung past the timeout, or left."""


class RankGroup:
    """This process's place in a tensor-parallel group, and the messages rank 0 sends the others."""

    def __init__(self, rank: int, world: int, timeout_s: float, device: torch.device | str = "cpu"):
        import torch.distributed as dist

        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.device = torch.device(device)
        self.leads = rank == 0
        self.dist = dist
        self.progress = 0  # messages handled
        self.last_sent = time.monotonic()
        self.message: torch.Tensor | None = None
        self._payload: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self._watch = None
        self._closed = False
        self._stop_watchdog = threading.Event()
        self.store = None

    # -- set-up

    @classmethod
    def join(cls, timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S, device: str = "cpu") -> "RankGroup":
        """Join the group of the rendezvous environment (gloo for a cpu plan, NCCL for cuda) and set it as the
        step's collective group."""
        import torch.distributed as dist

        env = rendezvous_env()
        if env is None:
            raise RuntimeError("not started as a rank: RANK and WORLD_SIZE are not set")
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        if device == "cuda":
            torch.cuda.set_device(int(env["LOCAL_RANK"] or 0))
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        group = cls(rank, world, timeout_s, "cuda" if device == "cuda" else "cpu")
        collectives.set_group(dist.group.WORLD)
        group.store = _default_store()
        group._start_watchdog()
        return group

    @classmethod
    def alone(cls, device: str = "cpu", timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> "RankGroup":
        """A group of one rank in this process (NCCL on cuda, gloo on cpu): every collective is real but sums one
        part. What a one-GPU machine can check of a tensor-parallel step: its collectives captured in CUDA graphs
        (tools/gpu_check.py, phase tp_capture)."""
        import torch.distributed as dist

        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1, timeout=timedelta(seconds=timeout_s))
        collectives.set_group(dist.group.WORLD)
        return cls(0, 1, timeout_s, device)

    def bind(self, buckets: Sequence[int], max_seqs: int) -> None:
        """Allocate the step message and the counts once (the plan's collective bytes), with a view per step input
        of each bucket."""
        numel = message_numel(buckets, max_seqs)
        self.message = torch.zeros(numel, dtype=torch.int64, device=self.device)
        self.counts = torch.zeros(self.world, dtype=torch.int64, device=self.device)
        self.ack = torch.zeros(1, dtype=torch.int64, device=self.device)
        # Scalars go through numpy views of host memory: `tensor[i] = value` makes a 0-d tensor (an allocation).
        # On CPU the views are the buffers themselves; on CUDA pinned copies staged with copy_.
        on_host = self.device.type == "cpu"
        self._header = self.message[:HEADER] if on_host else torch.zeros(HEADER, dtype=torch.int64, pin_memory=True)
        self._count = self.counts if on_host else torch.zeros(self.world, dtype=torch.int64, pin_memory=True)
        self._header_np, self._count_np = self._header.numpy(), self._count.numpy()
        for t in buckets:
            views, at = [], HEADER
            sizes = step_input_shapes(t, max_seqs)
            for name, _ in STEP_INPUT_DTYPES:
                views.append((name, self.message[at : at + sizes[name]]))
                at += sizes[name]
            self._payload[t] = views

    def ready(self, startup_timeout_s: float) -> None:
        """Every rank has built its engine: a barrier that names the ranks that did not arrive in time."""
        try:
            if self.device.type == "cpu":
                self.dist.monitored_barrier(timeout=timedelta(seconds=startup_timeout_s), wait_all_ranks=True)
            else:
                self.dist.barrier()
        except RuntimeError as err:
            raise GroupFailed(f"rank {self.rank}: the ranks did not all start: {err}") from None

    # -- rank 0: messages

    def _send(self, op: int, *operands: int) -> None:
        h = self._header_np
        h[0], h[1] = op, self.progress
        h[2 : 2 + len(operands)] = operands
        if self.device.type != "cpu":  # synchronous: the next message rewrites the pinned header
            self.message[:HEADER].copy_(self._header)
        self._collective(self.dist.broadcast, self.message, 0)
        self.progress += 1
        self.last_sent = time.monotonic()

    def send_step(self, bucket: int, inputs: Mapping[str, torch.Tensor]) -> None:
        for name, view in self._payload[bucket]:
            view.copy_(inputs[name])
        self._send(OP_STEP, bucket)

    def send_copy(self, src: int, dst: int, rows: int) -> None:
        self._send(OP_COPY, src, dst, rows)

    def ping_if_idle(self) -> None:
        """An idle group's heartbeat: every rank answers, so a dead or hung rank is found within the timeout."""
        if time.monotonic() - self.last_sent >= PING_S:
            self._send(OP_PING)
            self._collective(self.dist.all_reduce, self.ack)

    def check_begin(self, single_thread: bool) -> None:
        self._send(OP_CHECK_BEGIN, int(single_thread))

    def check_end(self) -> list[int]:
        """Each rank's count of storages allocated since check_begin (rank 0's own is counted by its caller)."""
        self._send(OP_CHECK_END)
        self._count_np[:] = 0
        return self._sum_counts()

    def _sum_counts(self) -> list[int]:
        if self.device.type != "cpu":
            self.counts.copy_(self._count)
        self._collective(self.dist.all_reduce, self.counts)
        return [int(c) for c in self.counts.tolist()]

    def send_capture(self) -> None:
        """CUDA: every rank captures its graphs now (Engine.capture_graphs), in step with rank 0."""
        self._send(OP_CAPTURE)

    def stop(self) -> None:
        """Tell the followers to exit (rank 0, after draining)."""
        if not self._closed:
            self._send(OP_STOP)

    # -- followers

    def receive(self) -> tuple[int, list[int]]:
        self._collective(self.dist.broadcast, self.message, 0)
        header = self.message[:HEADER].tolist()  # Python ints: no tensor storage
        self.progress += 1
        return int(header[0]), [int(v) for v in header[2:]]

    def unpack(self, bucket: int, inputs: Mapping[str, torch.Tensor]) -> None:
        for name, view in self._payload[bucket]:
            inputs[name].copy_(view)

    def follow(self, engine) -> None:
        """A follower's serving loop: run what rank 0 sends until STOP. Raises GroupFailed when the group breaks."""
        while True:
            op, args = self.receive()
            if op == OP_STEP:
                bucket = args[0]
                self.unpack(bucket, engine.inputs[bucket].tensors())
                engine._run_step(bucket)
            elif op == OP_COPY:
                engine._copy_rows(args[0], args[1], args[2])
            elif op == OP_PING:
                self._collective(self.dist.all_reduce, self.ack)
            elif op == OP_CHECK_BEGIN:
                from slabserve.runtime.executor import AllocationWatch

                self._watch = AllocationWatch(single_thread=bool(args[0]))
            elif op == OP_CHECK_END:
                found = self._watch.stop() if self._watch is not None else []
                self._watch = None
                if found:
                    log.error(json.dumps({"event": "rank_allocated", "rank": self.rank, "storages": len(found),
                                          "under": sorted({" > ".join(a.ops) for a in found})[:5]}))
                self._count_np[:] = 0
                self._count_np[self.rank] = len(found)
                self._sum_counts()
            elif op == OP_CAPTURE:
                engine.capture_graphs()
            elif op == OP_STOP:
                return
            else:
                raise GroupFailed(f"rank {self.rank}: unknown message {op} from rank 0")

    # -- faults

    def _collective(self, fn, tensor: torch.Tensor, *args) -> None:
        try:
            fn(tensor, *args)
        except RuntimeError as err:
            self._closed = True
            raise GroupFailed(f"rank {self.rank}: a collective of the tensor-parallel group failed: {err}") from err

    def _start_watchdog(self) -> None:
        if self.store is None:
            return
        key = f"{_STORE_PREFIX}{self.rank}"
        host = socket.gethostname()

        def beat() -> None:
            while True:  # at once, then every WATCHDOG_S
                try:
                    self.store.set(key, json.dumps({"progress": self.progress, "time": time.time(),
                                                    "pid": os.getpid(), "host": host}))
                except Exception:  # noqa: BLE001 - the store's host is gone: the group is going down anyway
                    return
                if self._stop_watchdog.wait(WATCHDOG_S):
                    return

        beat_thread = threading.Thread(target=beat, name=f"slabserve-rank{self.rank}-watchdog", daemon=True)
        beat_thread.start()

    def diagnose(self) -> list[dict]:
        """After a failed collective: every other rank's last report, and why it is suspect (gone, or silent for
        longer than two watchdog periods, or behind rank 0's messages)."""
        found = []
        if self.store is None:
            return found
        now, host = time.time(), socket.gethostname()
        for r in range(self.world):
            if r == self.rank:
                continue
            entry = {"rank": r}
            try:
                self.store.wait([f"{_STORE_PREFIX}{r}"], timedelta(seconds=2))
                seen = json.loads(self.store.get(f"{_STORE_PREFIX}{r}"))
            except Exception:  # noqa: BLE001
                entry["why"] = "never reported to the rendezvous store"
                found.append(entry)
                continue
            entry.update(pid=seen["pid"], progress=seen["progress"], silent_s=round(now - seen["time"], 1))
            gone = seen["host"] == host and not _alive(seen["pid"])
            if gone:
                entry["why"] = "its process is gone"
            elif seen["host"] == host and _stopped(seen["pid"]):
                entry["why"] = "its process is stopped (SIGSTOP)"
            elif now - seen["time"] > 2 * WATCHDOG_S + 1:
                entry["why"] = f"silent for {entry['silent_s']} s"
            elif seen["progress"] < self.progress - 1:
                entry["why"] = f"behind: handled {seen['progress']} of {self.progress} messages"
            else:
                continue
            found.append(entry)
        return found

    def close(self) -> None:
        self._stop_watchdog.set()
        collectives.set_group(None)
        try:
            self.dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group cannot always be torn down cleanly; the process ends
            pass


def _default_store():
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001 - a private helper; without it faults are still found, only not named
        return None


def _alive(pid: int) -> bool:
    from slabserve.runtime.client import _alive as signalable  # os.kill(pid, 0), as `slabserve health` uses it

    if not signalable(pid):
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is gone too
        return _proc_state(pid) != "Z"
    except OSError:
        return True


def _stopped(pid: int) -> bool:
    try:
        return _proc_state(pid) in ("T", "t")
    except OSError:
        return False


def _proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


# ---------------------------------------------------------------------------------------------------- the launcher


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loopback_interface() -> str:
    """The loopback interface's name ("lo" on Linux), from the kernel's list when it can be read."""
    try:
        for _, name in socket.if_nameindex():
            if name.startswith("lo"):
                return name
    except OSError:
        pass
    return "lo"


def _terminate_with_parent() -> None:
    """In a rank, before exec: SIGTERM when the launcher dies, even by SIGKILL (Linux prctl PR_SET_PDEATHSIG), so
    no rank outlives it: rank 0 drains and stops the others (which ignore SIGTERM and follow rank 0's STOP)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the launcher's own monitoring still takes the group down when a rank fails


def launch(degree: int, argv: Sequence[str], timeout_s: float) -> int:
    """`slabserve serve DIR` for a plan of `degree` ranks: start one process per rank with the rendezvous
    environment (rank 0 serves; the others follow), forward SIGTERM/SIGINT to rank 0 (which drains, then stops the
    others), and when any rank exits before that, take the whole group down within the collective timeout plus a
    grace period (SIGTERM, then SIGKILL): no orphan is left. Returns the exit code: 0 after a clean drain."""
    port = _free_port()
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // degree))
    procs: list[subprocess.Popen] = []
    for rank in range(degree):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(degree), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(degree), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": threads,
               # every rank is on this host: gloo talks over loopback, not whatever the host name resolves to
               "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME") or _loopback_interface()}
        procs.append(subprocess.Popen([sys.executable, *(["-P"] if sys.flags.safe_path else []), "-m",
                                       "slabserve.runtime.serve_cli", *argv], env=env,
                                      preexec_fn=_terminate_with_parent))
    log.info(json.dumps({"event": "ranks_started", "degree": degree, "pids": [p.pid for p in procs],
                         "master_port": port, "threads_per_rank": int(threads)}))
    stopping = threading.Event()

    def forward(signum, _frame) -> None:
        stopping.set()
        if procs[0].poll() is None:
            procs[0].send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    failed_at: float | None = None  # a follower exited on its own: rank 0 should find out and end
    leader_gone_at: float | None = None
    code = 0
    while True:
        states = [p.poll() for p in procs]
        if all(s is not None for s in states):
            break
        now = time.monotonic()
        for rank, (p, s) in enumerate(zip(procs, states)):
            if rank and s is not None and failed_at is None and not stopping.is_set() and leader_gone_at is None:
                failed_at, code = now, 1
                log.error(json.dumps({"event": "rank_exited", "rank": rank, "pid": p.pid, "returncode": s,
                                      "signal": signal.Signals(-s).name if s < 0 else None}))
        if states[0] is not None and leader_gone_at is None:
            leader_gone_at = now  # the followers have nothing left to follow: they end when the group breaks
            if states[0]:
                code = code or 1
                log.error(json.dumps({"event": "rank_exited", "rank": 0, "pid": procs[0].pid,
                                      "returncode": states[0]}))
        if leader_gone_at is not None and now - leader_gone_at > 5:
            for p in procs:
                if p.poll() is None:
                    p.kill()  # a stopped (SIGSTOP) or hung follower too
        elif failed_at is not None and now - failed_at > timeout_s + 5 and procs[0].poll() is None:
            procs[0].terminate()  # rank 0 did not find the fault itself: drain it (health NOT_SERVING)
            leader_gone_at = now
        time.sleep(0.1)
    if any(p.returncode for p in procs):
        code = code or 1
    log.info(json.dumps({"event": "ranks_stopped", "returncodes": [p.returncode for p in procs]}))
    return code
