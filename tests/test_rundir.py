"""The run directory of `fedpool eval run | resume | replay` (clients/rundir.py): its plan, read back as written
and from runs saved by earlier versions; specs checked before anything is written; waiting for a model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fedpool.clients.rundir import (
    EVAL_FILE,
    NoServerError,
    RunDirError,
    RunPlan,
    check_specs,
    duplicate_names,
    failed_records_hint,
    pool_flags_given,
    refuse_existing_run,
    wait_for_model,
)
from fedpool.pipeline import load_spec
from fedpool.pipeline.bundled import bundled_spec_paths

BUNDLED = {p.stem: p for p in bundled_spec_paths()}


def test_a_plan_reads_back_as_written_and_old_plans_keep_their_routing(tmp_path: Path) -> None:
    plan = RunPlan(specs=[str(BUNDLED["arith"])], model="m", revision="r1", policy="least_inflight",
                   concurrency=8, client_order="shortest_first", planned=True)
    plan.write(tmp_path)
    assert RunPlan.read(tmp_path) == plan and RunPlan.read(tmp_path).routing == "planned"
    # A plan written before `planned`, `client_order` and `replay_of` existed: the defaults those runs had.
    (tmp_path / EVAL_FILE).write_text(json.dumps({"specs": ["a.yaml"], "model": "m", "revision": None,
                                                  "policy": "round_robin", "concurrency": 4, "limit": 2}))
    old = RunPlan.read(tmp_path)
    assert (old.routing, old.client_order, old.limit, old.replay_of) == ("round_robin", "fair", 2, None)
    with pytest.raises(RunDirError, match="already holds a run"):
        refuse_existing_run(tmp_path)


def test_a_run_records_the_pool_flags_it_was_given_and_its_hints_carry_them(tmp_path: Path) -> None:
    defaults = {"state_dir": Path("~/.fedpool/registry"), "address": "auto", "registry_url": None, "token_path": None}
    given = pool_flags_given({**defaults, "state_dir": Path("pools/a b"), "registry_url": "http://h:1"}, defaults)
    assert given == {"state_dir": str((Path("pools/a b")).resolve()), "registry_url": "http://h:1"}
    assert pool_flags_given(defaults, defaults) == {}
    plan = RunPlan(specs=[str(BUNDLED["arith"])], model="m", concurrency=4, pool=given)
    plan.write(tmp_path)
    assert RunPlan.read(tmp_path).pool_settings() == {"state_dir": Path("pools/a b").resolve(),
                                                      "registry_url": "http://h:1"}
    command = f"fedpool eval resume --state-dir '{Path('pools/a b').resolve()}' --registry-url http://h:1 {tmp_path}"
    assert plan.resume_command(tmp_path) == command
    with pytest.raises(RunDirError, match=f"use `{re.escape(command)}` or another --out"):
        refuse_existing_run(tmp_path)


def test_records_refused_as_they_are_are_not_offered_a_resume() -> None:
    resume = "fedpool eval resume --state-dir /p runs/x"
    assert failed_records_hint([{"timeout": 2}, {"no_server": 1}], 3, resume) == (
        f"3 record(s) failed; `{resume}` runs them again")
    only = failed_records_hint([{"request_error": 2}, {}], 2, resume)
    assert "eval resume" not in only and "2 record(s) refused as they are" in only and "resume will not help" in only
    both = failed_records_hint([{"request_error": 1, "timeout": 1}, {"data": 1}], 3, resume)
    assert both.startswith(f"1 record(s) failed; `{resume}` runs them again; 2 record(s) refused as they are")


@pytest.mark.parametrize(("text", "fragment"), [
    ('{"specs": [', "damaged"),
    ('{"specs": [], "model": "m"}', "specs"),
    ('{"specs": ["a.yaml"]}', "model"),
    ("[1, 2]", "damaged"),
])
def test_a_damaged_plan_is_named(tmp_path: Path, text: str, fragment: str) -> None:
    (tmp_path / EVAL_FILE).write_text(text)
    with pytest.raises(RunDirError, match=fragment) as exc:
        RunPlan.read(tmp_path)
    assert str(tmp_path / EVAL_FILE) in str(exc.value)


def test_specs_given_twice_or_named_alike_are_refused(tmp_path: Path) -> None:
    arith = BUNDLED["arith"]
    with pytest.raises(RunDirError, match="given twice"):
        check_specs([arith, arith], None)
    copy = tmp_path / "copy.yaml"
    copy.write_text(arith.read_text().replace("path: ", f"path: {arith.parent}/", 1))
    with pytest.raises(RunDirError, match=r"unique in one run: arith \(from --spec .*copy.yaml"):
        check_specs([arith, copy], None)
    assert duplicate_names([load_spec(arith), load_spec(arith), load_spec(BUNDLED["capitals"])]) == ["arith"]
    assert [s.name for s in check_specs([arith, BUNDLED["capitals"]], 3)] == ["arith", "capitals"]


@pytest.mark.looptime
async def test_waiting_for_a_model_returns_once_it_is_served_or_names_what_is() -> None:
    served: dict[str, set[str]] = {"other": {"unspecified"}}
    calls = 0

    async def registered() -> dict[str, set[str]]:
        nonlocal calls
        calls += 1
        if calls == 3:
            served["m"] = {"r1"}
        return served

    await wait_for_model(registered, "m", "r1", 10.0, "wait")
    assert calls == 3
    with pytest.raises(NoServerError, match=r"'m' revision 'r2' after waiting 2 s \(the pool serves: m, other\)"):
        await wait_for_model(registered, "m", "r2", 2.0, "pass --wait-for-servers")
