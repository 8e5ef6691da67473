"""Shared fixtures: the one way tests find ../shared/data, tiny throwaway models, and the one
tiny-pipeline run the end-to-end tests share, the one served deployment the UI tests share, and
the one two-node Ray cluster the multi-node tests share, and the one S3-compatible server and the
one Google Cloud Storage emulator the object-store tests share."""
from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from corpus_helpers import crawl_server  # noqa: F401  the local Common Crawl server fixture
from pipeline_helpers import FAST, STAGES, TinyRun, committed_dir, gristmill, plan_of
from train_helpers import tokenize_dir  # noqa: F401  the tokenize output the training tests share

from bench.harness.runs import SHARED_DATA

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The migrated database templates new homes copy (infra/schemas.py): one set for the session,
# built by its first run, rather than whatever the user's cache holds.
os.environ.setdefault("GRISTMILL_CACHE", tempfile.mkdtemp(prefix="gristmill-test-cache-"))

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from threads; on a shared 2-core machine OpenMP threads that wait
    on each other make every step many times slower. Modules that train use it."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def kill_at_metrics_step(monkeypatch):
    """`kill(step)` makes the step-`step` metrics line raise KeyboardInterrupt, as a kill -9 would
    stop a training stage there; `kill(None)` lets training run normally again."""
    from gristmill.core.stage import MetricsLog

    real_log = MetricsLog.log

    def kill(step: int | None) -> None:
        def log(self, at, **values):
            if at == step:
                raise KeyboardInterrupt("simulated kill")
            real_log(self, at, **values)

        monkeypatch.setattr(MetricsLog, "log", real_log if step is None else log)

    return kill


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Real data written by others (see its SOURCES.md). In CI its absence is a failure."""
    path = SHARED_DATA
    if not path.is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"shared data not found at {path}; set GRISTMILL_SHARED_DATA")
        pytest.skip(f"shared data not found at {path}")
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory, shared_data) -> Path:
    """A byte-level BPE trained in-process on real text, saved as an HF tokenizer dir."""
    from gristmill.tasks.tokenize.stage import save_tokenizer, train_tokenizer

    text = (shared_data / "corpus" / "tinyshakespeare.txt").read_text()
    docs = [text[i : i + 2000] for i in range(0, 400_000, 2000)]
    out = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(train_tokenizer(docs, vocab_size=1024), out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """A randomly initialised tiny Llama exported with its tokenizer (loads with Auto*). Seeded:
    the same model whichever test asks first (tests tuned on it would otherwise depend on order)."""
    import torch
    from transformers import AutoTokenizer

    from gristmill.model.export import export_model
    from gristmill.model.presets import ModelConfig, build_model

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    torch.manual_seed(0)
    model = build_model(ModelConfig(hidden_size=64, num_layers=2, num_heads=4,
                                    intermediate_size=128, max_seq_len=256), tokenizer)
    out = tmp_path_factory.mktemp("model")
    export_model(model, tokenizer, out)
    return out


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, shared_data) -> TinyRun:
    """The tiny pipeline, run once through the real CLI (Prefect's ephemeral API, MLflow on SQLite,
    a local Ray) in a fresh GRISTMILL_HOME, shared by every end-to-end test."""
    # Compression is reported next to GPT-2's vocabulary when its rank file is at hand.
    reference_vocab = f"tokenize.reference_vocab={shared_data / 'tokenizer' / 'gpt2.tiktoken'}"
    # two real benchmarks, 20 items each: scores, contamination and the report card end to end
    eval_dir = shared_data / "eval"
    benchmarks = (f"evaluate.tasks=[{eval_dir / 'hellaswag' / 'hellaswag_val_part1.jsonl'},"
                  f"{eval_dir / 'arc_easy' / 'arc_easy_part1.jsonl'}]")
    overrides = [*FAST, reference_vocab, benchmarks, "evaluate.limit=20"]
    home = tmp_path_factory.mktemp("e2e") / "home"
    assert plan_of(home, overrides) == {s: "run" for s in STAGES}
    proc = gristmill(home, "run", "configs/tiny.yaml", *overrides)
    return TinyRun(home=home, proc=proc, overrides=overrides, reference_vocab=reference_vocab,
                   committed={stage: committed_dir(home, stage) for stage in STAGES})


@pytest.fixture
def two_ray_nodes(ray_cluster):
    """The session's two Ray nodes (`ray_cluster`), the second restored first where an earlier
    test lost it."""
    ray_cluster.restore_second()
    return ray_cluster


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A Ray head and a second node on this machine that share no disk (tests/ray_cluster.py: the
    second runs in its own mount namespace, an empty tmpfs over the tests' temp root, the system
    temp dir and GRISTMILL_CACHE), started once for every multi-node test: starting them takes
    about 15 s on 2 cores, and idle they hold about 1.6 GB and a few percent of a core until the
    session ends. Yields ray_cluster.TwoRayNodes: the environment a driver joins them with
    (RAY_ADDRESS...), and the second node to kill and replace."""
    from ray_cluster import two_ray_nodes as start_two_ray_nodes

    with start_two_ray_nodes(tmp_path_factory.mktemp("ray")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory) -> Iterator[dict[str, str]]:
    """One Prefect server (`gristmill up`'s, alone) for the end-to-end tests that run the pipeline
    many times: each run then skips starting and stopping Prefect's temporary server, the largest
    share of a reused run's time (docs/benchmarks.md). The shared tiny run, the data gate tests (a
    standing server would pause for a person instead), the two runs racing in a fresh home and
    the interrupts that must stop the run's own server keep the embedded one. Yields the
    environment a run uses it with."""
    from gristmill.infra import stack

    home = tmp_path_factory.mktemp("prefect") / "home"
    try:
        states = stack.up(home, ports=stack.Ports.free(), names=("prefect",))
        assert [s.state for s in states] == ["running"], stack.format_states(states)
        yield {k: v for s in states for k, v in s.export.items()}
    finally:
        stack.down(home)


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    """The stack and `gristmill serve` of the tiny preset (tests/serve_helpers.py), started once
    for the tests that drive the `pipeline` deployment: starting them costs minutes on 2 cores."""
    from serve_helpers import serving

    with serving(tmp_path_factory.mktemp("served")) as served:
        yield served


@pytest.fixture(scope="session")
def s3_server() -> Iterator[dict[str, str]]:
    """An S3-compatible server on 127.0.0.1 (moto's server mode: a real HTTP endpoint, here in a
    thread of the test process) with a bucket `crawl`. Yields the standard AWS variables that point
    boto3 and s3fs at it, for this process (set while the session lasts) and for subprocesses."""
    from bench.harness.emulators import s3_server

    with s3_server("crawl") as env, pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        yield env


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[dict[str, str]]:
    """A Google Cloud Storage emulator on 127.0.0.1 (fake-gcs-server) with a bucket `crawl`. Yields
    the variables that point gcsfs at it, set for this process while the session lasts and meant
    for subprocesses too."""
    from bench.harness.emulators import gcs_server
    from gristmill.core import object_store

    with gcs_server("crawl") as env, pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        object_store.forget()
        yield env
        object_store.forget()


@contextlib.contextmanager
def _behind_the_fault_proxy(request, scheme: str) -> Iterator[tuple[dict[str, str], object]]:
    """The `scheme` backend's emulator seen through the fault proxy (tests/fault_proxy.py): 5% of
    the connections reset mid-transfer, 5% delayed. Yields (the variables that point clients at the
    proxy, set for this process while it lasts and meant for subprocesses too, the proxy)."""
    from fault_proxy import FaultProxy

    from gristmill.core import object_store

    variable = "AWS_ENDPOINT_URL" if scheme == "s3" else "STORAGE_EMULATOR_HOST"
    env = request.getfixturevalue("s3_server" if scheme == "s3" else "gcs_server")
    with FaultProxy(int(env[variable].rsplit(":", 1)[1]), reset=0.05, delay=0.05, seed=11) as proxy, \
            pytest.MonkeyPatch.context() as patch:
        patch.setenv(variable, proxy.url)
        object_store.forget()
        try:
            yield {**env, variable: proxy.url}, proxy
        finally:
            object_store.forget()


@pytest.fixture(params=["s3", "gs"])
def faulty_endpoint(request) -> Iterator[tuple[str, dict[str, str], object]]:
    """Each backend behind the fault proxy: (scheme, its variables through the proxy, the proxy)."""
    with _behind_the_fault_proxy(request, request.param) as (env, proxy):
        yield request.param, env, proxy


@pytest.fixture
def faulty_s3(request) -> Iterator[tuple[dict[str, str], object]]:
    """The S3 server behind the fault proxy: (its variables through the proxy, the proxy)."""
    with _behind_the_fault_proxy(request, "s3") as found:
        yield found


@pytest.fixture
def faulty_gcs(request) -> Iterator[tuple[dict[str, str], object]]:
    """The GCS emulator behind the fault proxy: (its variables through the proxy, the proxy)."""
    with _behind_the_fault_proxy(request, "gs") as found:
        yield found


@pytest.fixture(params=["s3", "gs"])
def bucket_url(request, tmp_path) -> str:
    """A fresh prefix of the test bucket on each backend (the S3 server's, then the GCS emulator's)."""
    import uuid

    from gristmill.core import object_store

    request.getfixturevalue("s3_server" if request.param == "s3" else "gcs_server")
    object_store.forget()
    return f"{request.param}://crawl/t-{uuid.uuid4().hex[:8]}"
