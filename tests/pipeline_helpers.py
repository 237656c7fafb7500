"""Helpers for the pipeline tests: shards, bad inputs, a fake engine, a tiny saved checkpoint, a local Ray head.

The fake engine stands in for the core library where a test is about the pipeline's mechanics (resume,
faults, error rows), not about the methods: it is deterministic, needs no model, and can be made slow so
that a test can kill an actor or a job mid-run.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
RAY = str(Path(PY).parent / "ray")


# ---------------------------------------------------------------------- a job's output

# Lines that are not the project's own in a job's output (issue: a first-hour user's quickstart printed each kind).
NOISE = {
    "ANSI colour code": re.compile(r"\x1b\["),
    "Ray log record (INFO/SUCC/DEBUG/WARNING)": re.compile(r"^\S+ \S+\t(INFO|SUCC|DEBUG|WARNING) "),
    "Ray CLI banner": re.compile(r"Next steps|submitted successfully|Tailing logs until"),
    "actor-restart notice": re.compile(r"max_restarts > 0"),
    "Ray's actor prefix": re.compile(r"^\((MapWorker|\w+)[^)]* pid=\d+"),
    "Ray Data memory warning": re.compile(r"memory per worker|logical memory was"),
    "CUDA_HOME probe": re.compile(r"No CUDA runtime is found"),
    "glog-style info/warning line": re.compile(r"^[IW]\d{4} \d\d:\d\d:\d\d"),
    "Python warning": re.compile(r"Warning|Deprecat"),
}


def noise_lines(text: str) -> dict[str, list[str]]:
    """{kind: lines} of every line of ``text`` that matches a kind of noise (empty: only the project's lines)."""
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        for kind, pattern in NOISE.items():
            if pattern.search(line):
                found.setdefault(kind, []).append(line)
    return found


# ---------------------------------------------------------------------- shards


def synthetic_records(task: str, n: int, seed: int = 0) -> list[dict]:
    from pipeline.data.synthetic import make_record

    return [make_record(task, seed, i) for i in range(n)]


def write_shard(path: Path, records: list[dict]) -> Path:
    from pipeline.schema import INPUT_SCHEMA

    path.parent.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([pa.field(f.name, f.type) for f in INPUT_SCHEMA])  # nullable: bad rows allowed
    prompts = [r.get("prompt") for r in records]
    table = pa.Table.from_pylist([dict(r, prompt=None) if isinstance(r.get("prompt"), bytes) else r
                                  for r in records], schema=schema)
    if any(isinstance(p, bytes) for p in prompts):  # a bytes prompt is written as is: Parquet does not check UTF-8
        raw = pa.array([p if isinstance(p, bytes) or p is None else p.encode() for p in prompts], pa.binary())
        table = table.set_column(schema.get_field_index("prompt"), "prompt",
                                 raw.view(schema.field("prompt").type))
    pq.write_table(table, path)
    return path


def _img_bytes(img, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def bad_input_records(base: dict) -> tuple[list[dict], dict[str, str | None]]:
    """One record per kind of bad input, plus the awkward-but-valid image modes.

    Returns (records, expectation) where expectation maps each output sample_id to the substring its
    error must contain, or None if it must have an output.
    """
    from PIL import Image

    rgb = Image.open(io.BytesIO(base["images"][0])).convert("RGB")
    png = base["images"][0]

    def rec(sid, **kw):
        r = dict(base, sample_id=sid)
        r.update(kw)
        return r

    huge = _img_bytes(Image.new("1", (12000, 12000)), "PNG")  # 144 MP, a few KB on disk
    records = [
        rec("good-a"),
        rec("corrupt", images=[png[: len(png) // 3]]),  # truncated PNG
        rec("garbage", images=[b"this is not an image at all" * 10]),
        rec("empty-image", images=[b""]),
        rec("huge", images=[huge]),
        rec("cmyk", images=[_img_bytes(rgb.convert("CMYK"), "JPEG")]),
        rec("rgba", images=[_img_bytes(rgb.convert("RGBA"), "PNG")]),
        rec("grey", images=[_img_bytes(rgb.convert("L"), "PNG")]),
        rec("video-0-frames", task="video", images=[], prompt="Describe what happens in this video."),
        rec("empty-prompt", prompt="   "),
        rec("good-b", images=[_img_bytes(rgb.transpose(Image.FLIP_LEFT_RIGHT), "PNG")]),
        rec("truncated-png", images=[png[: len(png) - len(png) // 4]]),  # header whole, pixel data cut
        rec("prompt-bad-utf8", prompt=b"Describe \xff\xfe this image."),
        rec("prompt-null", prompt=None),
        rec("too-long", prompt="Describe every detail " * 1400),  # > 4096 tokens with the image
        rec("video-over-cap", task="video", images=[png] * 65, prompt="Describe what happens in this video."),
        rec("good-a", prompt=base["prompt"] + " Again."),  # last: duplicate sample_id -> good-a#dup2
    ]
    expect = {
        "good-a": None, "good-b": None, "cmyk": None, "rgba": None, "grey": None,
        "corrupt": "corrupt", "garbage": "corrupt or not an image", "empty-image": "empty (0 bytes)",
        "huge": "huge", "video-0-frames": "0 frames", "empty-prompt": "prompt is empty",
        "good-a#dup2": "duplicate sample_id 'good-a'",
        "truncated-png": "bad input: image 0 is corrupt", "prompt-bad-utf8": "bad input: prompt is not valid UTF-8",
        "prompt-null": "bad input: prompt is empty", "too-long": "exceeds the model's context of",
        "video-over-cap": "video has 65 frames, more than max_frames=64",
    }
    return records, expect


# ---------------------------------------------------------------------- fake engine


class FakeResult:
    """What the pipeline reads of an ``rcr.GenerationResult``: ``sample(b)``'s trimmed arrays, ``lengths``,
    ``prefix_len`` and the timings."""

    def __init__(self, seqs: list[list[int]], n_layers: int, seed: int, prefill_s: float, decode_s: float):
        self.seqs, self.n_layers, self.seed = seqs, n_layers, seed
        self.lengths = np.array([len(s) for s in seqs])
        self.prefix_len = np.full(len(seqs), 64)
        self.prefill_s, self.decode_s = prefill_s, decode_s

    def sample(self, b: int) -> dict:
        t = len(self.seqs[b])
        rng = np.random.default_rng(self.seed + b)
        drift = rng.random((self.n_layers, t)).astype(np.float32) * 0.1
        per_step = {k: np.full((self.n_layers, t), v) for k, v in
                    (("keys_read", 160.0), ("values_read", 32.0), ("detector_dots", 10.0))}
        return {"tokens": np.array(self.seqs[b]), "drift": drift, "drift_exact": None, "trigger": drift > 0.05,
                "tau": np.full((self.n_layers, t), 0.05, np.float32), "top_prefix_pos": None, **per_step}


class FakeEngine:
    """Deterministic stand-in for the core: output tokens are a function of (prompt, image bytes, method)."""

    def __init__(self, cfg, device, dtype):
        self.cfg = cfg
        self.n_layers = 2
        self.calls = 0

    def run(self, prompts, images, methods, task=None):
        self.calls += 1
        if any("CRASH" in p for p in prompts):
            raise RuntimeError("fake engine crash on request")
        if any("OOM" in p for p in prompts):  # what torch raises when a batch does not fit the device
            import torch

            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        out = {}
        for m in methods:
            seqs = []
            for p, ims in zip(prompts, images):
                h = zlib.crc32((p + m + "".join(f"{im.size}{im.mode}" for im in ims)).encode())
                n = 3 + h % 5 if m != "full" else 6
                seqs.append([(h >> k) % 90 + 4 for k in range(min(n, self.cfg.max_new_tokens))])
            out[m] = FakeResult(seqs, self.n_layers, zlib.crc32(m.encode()), 0.01, 0.02)
        return out

    def decode(self, ids) -> str:
        return " ".join(f"w{int(i)}" for i in ids)

    def recover(self) -> None:
        pass


class GatedFakeEngine(FakeEngine):
    """A FakeEngine that stops at a known point, so a test can interrupt a job there without timing.

    With ``RCR_TEST_GATE`` set to a path, the first ``RCR_TEST_GATE_AFTER`` calls (default 0) of each engine
    run at once; the next call touches ``<path>.waiting`` and ``<path>.waiting.<pid>`` (one per actor) and
    waits until ``<path>`` exists (the test's signal to go on; a test that stops the job never creates it)."""

    def run(self, prompts, images, methods, task=None):
        gate = os.environ.get("RCR_TEST_GATE")
        if gate and self.calls >= int(os.environ.get("RCR_TEST_GATE_AFTER", "0")) and not Path(gate).exists():
            Path(f"{gate}.waiting.{os.getpid()}").touch()
            Path(f"{gate}.waiting").touch()
            while not Path(gate).exists():
                time.sleep(0.05)
        return super().run(prompts, images, methods, task)


# ---------------------------------------------------------------------- models


def fake_model_dir(root: Path) -> Path:
    """A directory that passes the model check (config.json with a supported model_type); no weights."""
    d = root / "fake-model"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    return d


def tiny_qwen2_vl_dir(root: Path) -> Path:
    """A tiny random Qwen2-VL saved like a real checkpoint (model + processor), built from a config."""
    d = root / "tiny-qwen2-vl"
    if (d / "config.json").is_file():
        return d
    from tests import tiny_models

    model, proc = tiny_models.qwen2_vl()
    model.save_pretrained(d)
    proc.save_pretrained(d)
    return d


# ---------------------------------------------------------------------- a local Ray head on 127.0.0.1


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports the OS hands out as free now (from its ephemeral range).

    All sockets stay bound until every port is picked, so the same port is never returned twice."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def worker_port_block(size: int, rng: random.Random) -> int:
    """First port of ``size`` consecutive free ports *below* the OS ephemeral range.

    Ray refuses to start when its worker-port range contains a port given to another component, and the
    other components' ports come from the ephemeral range (``free_ports``), so a block below it can never
    collide with them."""
    try:
        eph_lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        eph_lo = 32768
    for _ in range(50):
        lo = rng.randrange(10000, max(10001, eph_lo - size))
        if all(_bindable(p) for p in range(lo, lo + size)):
            return lo
    raise RuntimeError(f"no {size} consecutive free ports below {eph_lo}")


def kill_leftovers(own_pids, temp_dir: Path) -> None:
    """SIGKILL what a stopped Ray head or cluster left (``own_pids()``: the processes it started; its workers
    outlive their raylet for a moment), then remove its private temp dir."""
    import shutil

    for _ in range(20):
        left = own_pids()
        if not left:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
    shutil.rmtree(temp_dir, ignore_errors=True)


class _PortClash(RuntimeError):
    """``ray start`` exited at once and its log mentions a port."""


class LocalRayHead:
    """`ray start --head --block` on 127.0.0.1 with private ports and temp dir; stopped by its own pid.

    ``ray stop`` would stop every Ray process on the machine (other people's too), so this never calls it:
    the blocking ``ray start`` process is in its own process group, and stopping it (SIGTERM, then SIGKILL
    to the group) takes down the head it started. Leftovers are found by the private temp dir in their
    command line and killed by pid.
    """

    def __init__(self, tmp: Path, num_cpus: int = 2):
        self.tmp = Path(tmp)
        # the session dir path must stay short (unix socket paths are limited to 107 bytes)
        self.temp_dir = Path("/tmp") / f"rcrt{os.getpid()}_{free_port()}"
        self.num_cpus = num_cpus
        self.proc: subprocess.Popen | None = None
        self.gcs_port, self.dashboard_port = free_ports(2)  # re-picked by start() on a port clash
        self.log = self.tmp / "ray-head.log"
        import secrets

        self.token = secrets.token_hex(32)

    def env(self) -> dict:
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)
        env["RAY_ADDRESS"] = self.address
        env["PATH"] = f"{Path(PY).parent}:{env.get('PATH', '')}"
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        env["RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES"] = ""  # infra/runtime_env.yaml names them
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # single-node mode: every socket on 127.0.0.1 (docs/pipeline.md)
        # Ray 2.60 token auth, with a private token: independent of ~/.ray/auth_token (which any local
        # ray.init() creates, and which would otherwise switch a plain `ray start` into token mode)
        env["RAY_AUTH_MODE"] = "token"
        env["RAY_AUTH_TOKEN"] = self.token
        env.pop("RAY_AUTH_TOKEN_PATH", None)
        return env

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def start(self, timeout: float = 180, attempts: int = 3) -> LocalRayHead:
        """Start the head; a port taken between picking and binding (another process on the machine)
        makes ``ray start`` exit at once, and is retried with fresh ports."""
        rng = random.Random()
        for attempt in range(attempts):
            if attempt:
                self.gcs_port, self.dashboard_port = free_ports(2)
            try:
                return self._start_once(timeout, rng)
            except _PortClash:
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float, rng: random.Random) -> LocalRayHead:
        ports = free_ports(7)
        lo = worker_port_block(401, rng)
        cmd = [RAY, "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
               "--port", str(self.gcs_port), "--dashboard-host", "127.0.0.1",
               "--dashboard-port", str(self.dashboard_port), "--include-dashboard", "true",
               "--num-cpus", str(self.num_cpus), "--num-gpus", "0", "--temp-dir", str(self.temp_dir),
               "--ray-client-server-port", str(ports[0]), "--node-manager-port", str(ports[1]),
               "--object-manager-port", str(ports[2]), "--dashboard-agent-listen-port", str(ports[3]),
               "--dashboard-agent-grpc-port", str(ports[4]), "--metrics-export-port", str(ports[5]),
               "--runtime-env-agent-port", str(ports[6]),
               "--min-worker-port", str(lo), "--max-worker-port", str(lo + 400),
               "--object-store-memory", str(400 * 2**20), "--disable-usage-stats"]
        env = self.env()
        env.pop("RAY_ADDRESS")
        with open(self.log, "w") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, cwd=str(self.tmp))
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                text = self.log.read_text()
                kind = _PortClash if re.search(r"port|address already in use", text, re.I) else RuntimeError
                raise kind(f"ray start exited {self.proc.returncode}:\n{text[-3000:]}")
            if self._dashboard_answers() and self.ray_cli("job", "list", "--address", self.address,
                                                          timeout=60).returncode == 0:
                return self
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"the Ray head did not come up in {timeout}s:\n{self.log.read_text()[-3000:]}")

    def _dashboard_answers(self) -> bool:
        """Any HTTP answer (401 included: Ray 2.60 enables token auth) means the dashboard is up."""
        import urllib.error
        import urllib.request

        try:
            urllib.request.urlopen(f"{self.address}/api/version", timeout=2).close()
            return True
        except urllib.error.HTTPError:
            return True
        except Exception:  # noqa: BLE001
            return False

    def submit(self, args: list[str], cwd: Path = REPO, timeout: float = 600, wait: bool = True,
               runtime_env: dict | None = None) -> subprocess.CompletedProcess | subprocess.Popen:
        # as infra/quickstart.sh submits (infra/submit.py): infra/runtime_env.yaml's excludes (plus ``runtime_env``)
        cmd = [PY, str(REPO / "infra" / "submit.py"), "--address", self.address, "--runtime-env",
               str(REPO / "infra" / "runtime_env.yaml"), "--runtime-env-json", json.dumps(runtime_env or {}),
               "--", "python", *args]
        if wait:
            return subprocess.run(cmd, check=False, cwd=cwd, env=self.env(), capture_output=True, text=True,
                                  timeout=timeout)
        return subprocess.Popen(cmd, cwd=cwd, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

    def job_status(self, submission_id: str) -> str:
        r = self.ray_cli("job", "status", "--address", self.address, submission_id, timeout=60)
        text = (r.stdout + r.stderr).lower()  # e.g. "Job 'x' succeeded", "Job 'x' was stopped"
        for state in ("succeeded", "failed", "stopped", "running", "pending"):
            if re.search(rf"job '{re.escape(submission_id.lower())}'[^\n]*{state}", text):
                return state.upper()
        return "UNKNOWN"

    def wait_job(self, submission_id: str, timeout: float = 600) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = self.job_status(submission_id)
            if state in ("SUCCEEDED", "FAILED", "STOPPED"):
                return state
            time.sleep(2)
        raise TimeoutError(f"job {submission_id} still not finished after {timeout}s")

    def job_logs(self, submission_id: str) -> str:
        return self.ray_cli("job", "logs", "--address", self.address, submission_id, timeout=60).stdout

    def actor_pids(self, class_fragment: str) -> list[int]:
        r = self.ray_cli("list", "actors", "--address", self.address, "--format", "json", "--detail",
                         "--filter", "state=ALIVE", timeout=60)
        if r.returncode != 0:
            raise RuntimeError(r.stderr[-2000:])
        return [a["pid"] for a in json.loads(r.stdout) if class_fragment in (a.get("class_name") or "")]

    def ray_cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([RAY, *args], check=False, env=self.env(), capture_output=True, text=True,
                              timeout=timeout)

    def own_pids(self) -> list[int]:
        """Processes whose command line names this head's private temp dir or GCS port (its raylet, workers...)."""
        marks = (str(self.temp_dir), f"127.0.0.1:{self.gcs_port}", f"--gcs-address=127.0.0.1:{self.gcs_port}")
        pids = []
        for p in Path("/proc").iterdir():
            if not p.name.isdigit() or int(p.name) == os.getpid():
                continue
            try:
                cmdline = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if any(m in cmdline for m in marks):
                pids.append(int(p.name))
        return pids

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=8)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        kill_leftovers(self.own_pids, self.temp_dir)
