"""The compiled forward (torch.compile, `services/executor/compiled.py`) on a CPU.

The rest of the suite runs eager (tests/conftest.py says why); here engines compile, and:
- greedy tokens equal transformers' in fp32, on batches of every shape serving makes (staggered
  arrivals, chunked prefill, prefix-cache hits, single-token steps), with no recompile after the
  warmup: one graph serves them all;
- the warmup compiles a variant for each CPU team size the executor may step on (dynamo guards on
  the thread count): switching between them recompiles nothing, and the tokens stay the same;
- a second process compiling the same model builds no kernel again: it finds them all in inductor's
  cache under $PARKADE_HOME.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hf_reference import STORIES, hf_greedy
from test_engine_vs_transformers import MAX_NEW, make_prompts, run
from tiny_models import make_tiny_model
from transformers import AutoModelForCausalLM

from parkade.engine.args import EngineArgs
from parkade.engine.engine import Engine

ARRIVALS = [0, 0, 1, 2, 3, 3, 5, 8, 9, 12, 13, 14, 20, 21, 22, 30]


@pytest.fixture(scope="module")
def inductor_home(tmp_path_factory):
    """One $PARKADE_HOME (so one inductor cache) for the module, restored afterwards."""
    home = tmp_path_factory.mktemp("parkade-home")
    saved = {name: os.environ.get(name) for name in ("PARKADE_HOME", "TORCHINDUCTOR_CACHE_DIR")}
    os.environ["PARKADE_HOME"] = str(home)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(home / "inductor")
    yield home
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.mark.parametrize("model", ["stories260K", "llama", "mistral"])
def test_compiled_greedy_equals_transformers(inductor_home, tmp_path, model):
    # stories260K: head_dim 8 (the kernel's scalar path), trained weights; llama: GQA, untied head;
    # mistral: a sliding window of 8, shorter than most prompts.
    model_dir = STORIES if model == "stories260K" else make_tiny_model(tmp_path, model)
    vocab = AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size
    prompts = make_prompts(vocab)
    expected = hf_greedy(model_dir, prompts, MAX_NEW)
    args = EngineArgs(
        model=model_dir, dtype="float32", max_model_len=256, block_size=8, max_num_batched_tokens=32,
        enforce_eager=False,
    )  # fmt: skip
    engine = Engine(args, skip_tokenizer_init=True)
    executor = engine.core.executor
    assert executor.compiled is not None and executor.compiled.compile_s is not None
    got = run(engine, prompts, ARRIVALS)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"prompt {i} (len {len(prompts[i])}): {g} != {e}"
    assert engine.core.scheduler.kv.num_prefix_hits > 0
    assert executor.compiled.recompiles == 0, "every batch shape must fit the graph compiled at start"
    assert any((inductor_home / "inductor").rglob("*")), "the compiled code is cached under $PARKADE_HOME"


def test_each_team_size_is_compiled_at_warmup(inductor_home):
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # a team of two, whatever this machine's CPUs (it may hold one)
    try:
        args = EngineArgs(
            model=STORIES, dtype="float32", max_model_len=256, block_size=8, max_num_batched_tokens=32,
            enforce_eager=False, cpu_threads="auto",
        )  # fmt: skip
        engine = Engine(args, skip_tokenizer_init=True)
        executor = engine.core.executor
        team = executor.team
        assert team is not None and team.sizes == (2, 1)
        # The warm-up timed a small step on each size (the choice is this machine's: either).
        assert team.small_step_threads in (None, 1)
        assert executor.compiled.time_decode(16, 1) > 0 and executor.compiled.time_decode(3, 2) > 0
        team.small_step_threads = None  # every step on the size held below
        prompts = make_prompts(512)
        got = {}
        for size in (2, 1, 2):
            team.fixed = team.threads = size  # held there; the next step applies it on its thread
            got[size] = run(engine, prompts, ARRIVALS)
            assert torch.get_num_threads() == size
        assert got[1] == got[2]
        assert executor.compiled.recompiles == 0, "both sizes were compiled at warmup"
    finally:
        torch.set_num_threads(before)


CHILD = """
import sys
from parkade.engine.args import EngineArgs
from parkade.engine.engine import Engine
engine = Engine(EngineArgs(model=sys.argv[1], dtype="float32", max_model_len=256, block_size=8,
                           max_num_batched_tokens=32, enforce_eager=False), skip_tokenizer_init=True)
assert engine.core.executor.compiled.compile_s is not None
"""


def test_a_restarted_executor_builds_no_kernel_again(inductor_home):
    # NOTE: inductor's FX graph cache skips graphs holding oneDNN-packed weights (they cannot be
    # pickled), so a restart traces and generates code again; what it keeps is the build of every
    # C++ kernel, the slow part (docs/benchmarks.md has the times). The step's C++ wrapper
    # (`*.main.so`, compiled.py's cpp_wrapper) is built again: its source names the frozen
    # weights' addresses, new in every process (a few seconds and about 80 KB a start).
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}  # from PARKADE_HOME
    cache = inductor_home / "inductor"
    built, wrappers = [], []
    for _ in range(2):
        subprocess.run([sys.executable, "-c", CHILD, str(STORIES)], env=env, check=True, timeout=600)
        libraries = sorted(str(p) for p in cache.rglob("*.so"))
        built.append([p for p in libraries if not p.endswith(".main.so")])
        wrappers.append(len(libraries) - len(built[-1]))
    assert built[0], "the first start builds its kernels into $PARKADE_HOME/inductor"
    assert built[1] == built[0], "the second start found every kernel built"
    assert wrappers[0] >= 1, "the step runs from a C++ wrapper"


def test_enforce_eager_compiles_nothing():
    engine = Engine(EngineArgs(model=STORIES, dtype="float32", max_model_len=64), skip_tokenizer_init=True)
    assert engine.core.executor.compiled is None  # the suite's default, $PARKADE_ENFORCE_EAGER=1
