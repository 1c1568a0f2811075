"""A real `slabserve serve` process on a tiny plan bundle, for the fuzz and fault tests.

`build_tiny_bundle(root)` writes a tiny random-weight Llama (tests/_models.py) and its plan bundle under `root`
(the bundle names its model relative to `root`, so the server runs with `root` as its working directory).
`ServerProcess.start(root, ...)` runs `python -m slabserve.runtime.server` there and waits for its "serving" log line.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from slabserve.proto.slabserve.v1 import serving_pb2 as pb
from slabserve.proto.slabserve.v1 import serving_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
SERVING = health_pb2.HealthCheckResponse.SERVING
TINY_CLASSES = ({"tokens": 64, "count": 4}, {"tokens": 256, "count": 2})   # max_seqs 6, queue_limit 64 per class


def build_tiny_bundle(root: Path, name: str = "tiny-served", **spec_overrides) -> Path:
    """`root/model` (tiny model) and `root/bundle` (its plan); returns `root`."""
    from _models import make_served_tiny_model
    from slabserve.compiler.build import build_plan
    from slabserve.compiler.bundle import write_bundle
    from slabserve.compiler.spec import load_spec

    root.mkdir(parents=True, exist_ok=True)
    if not (root / "model").exists():
        make_served_tiny_model(root / "model")
    spec = {"name": name, "model": {"path": "model"}, "target": {"device": "cpu", "memory": "1GiB"},
            "max_seqs": 6, "step_tokens": 32, "buckets": [1, 8, 32], "max_context": 256, "queue_limit": 64,
            "kv": {"classes": [dict(c) for c in TINY_CLASSES]}, **spec_overrides}
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    write_bundle(build_plan(load_spec(root / "spec.yaml", base_dir=root), root), root / "bundle")
    return root


def server_env(scratch: Path) -> dict[str, str]:
    """The server's environment: the repository importable, and temporary and cache folders of its own under
    `scratch` (so a test can see whether the server wrote anything there)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for name in ("TMPDIR", "XDG_CACHE_HOME"):
        env[name] = str(scratch / name.lower())
        Path(env[name]).mkdir(parents=True, exist_ok=True)
    return env


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    log: Path
    address: str = ""
    channels: list = field(default_factory=list)

    @classmethod
    def start(cls, root: Path, *args: str, log_name: str = "server.log", wait: bool = True,
              bundle: str = "bundle") -> "ServerProcess":
        log = root / log_name
        with open(log, "w") as sink:
            proc = subprocess.Popen([sys.executable, "-m", "slabserve.runtime.server", bundle, "--port", "0",
                                     "--metrics-port", "-1", *args], cwd=root, stdout=sink,
                                    stderr=subprocess.STDOUT, env=server_env(root / "scratch"))
        server = cls(proc, log)
        if wait:
            server.address = server.wait_for("listening")["address"]
            server.wait_for("serving")
        return server

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_for(self, event: str, timeout: float = 300) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log.read_text().splitlines():
                if line.startswith("{") and json.loads(line).get("event") == event:
                    return json.loads(line)
            assert self.proc.poll() is None, f"server exited ({self.proc.returncode}):\n{self.text()[-3000:]}"
            time.sleep(0.05)
        raise AssertionError(f"no {event!r} line within {timeout} s:\n{self.text()[-3000:]}")

    def text(self) -> str:
        return self.log.read_text()

    def channel(self) -> grpc.Channel:
        channel = grpc.insecure_channel(self.address)
        self.channels.append(channel)
        return channel

    def stop(self) -> None:
        for channel in self.channels:
            channel.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def self_signed_cert(folder: Path) -> tuple[Path, Path]:
    """(cert.pem, key.pem) for localhost and 127.0.0.1, made by the openssl command (tests skip without it)."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


def health(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def idle_load(stub: pb_grpc.SlabServeStub, timeout: float = 30.0) -> pb.GetLoadResponse:
    """GetLoad once nothing runs or waits (an abort lands at the next engine step), or after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        load = stub.GetLoad(pb.GetLoadRequest(), timeout=10)
        if (load.running == 0 and load.queued == 0) or time.monotonic() > deadline:
            return load
        time.sleep(0.05)


def assert_every_slab_free(stub: pb_grpc.SlabServeStub) -> None:
    load = idle_load(stub)
    assert (load.running, load.queued) == (0, 0)
    assert [(c.free_slabs, c.total_slabs) for c in load.classes] == [(c["count"], c["count"]) for c in TINY_CLASSES]


def assert_serves(stub: pb_grpc.SlabServeStub, channel: grpc.Channel) -> None:
    """Health SERVING and a normal request runs to its end."""
    assert health(channel) == SERVING
    request = pb.GenerateRequest(prompt="The sky is", stopping=pb.StoppingOptions(max_tokens=4, ignore_eos=True))
    *_, last = stub.Generate(request, timeout=60)
    assert last.finished.reason == pb.FINISH_REASON_LENGTH and last.finished.usage.completion_tokens == 4
