"""Scenario units in forked processes: a process that dies is one line naming the policy
and the seed, and every other result is kept (issue 19)."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import replace
from typing import Any

import pytest

from chameleon_ft.sim import runner
from chameleon_ft.sim.forked import Send, run_forked
from chameleon_ft.sim.report import report_json, report_markdown
from chameleon_ft.sim.scenarios import preset_scenario

TEST_PID = os.getpid()


def _die(code: int | None = None) -> None:
    """End this process from outside (SIGKILL, as the kernel's OOM killer) or by exit code;
    never the test process itself."""
    assert os.getpid() != TEST_PID, "only a forked child may die here"
    if code is None:
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(code)


def test_run_forked_keeps_what_a_dead_process_sent_and_runs_the_others():
    def sends(n: int, then: int | None = None, die: bool = False) -> Any:
        def task(send: Send) -> None:
            for i in range(n):
                send(("item", i))
            if die:
                _die(then)
        return task

    got: dict[int, list[int]] = {}
    deaths = run_forked([sends(3), sends(2, die=True), sends(1, then=3, die=True), sends(4)],
                        jobs=2, on_message=lambda t, m: got.setdefault(t, []).append(m[1]))
    assert got == {0: [0, 1, 2], 1: [0, 1], 2: [0], 3: [0, 1, 2, 3]}
    assert [(d.task, d.exitcode) for d in deaths] in ([(1, -signal.SIGKILL), (2, 3)],
                                                      [(2, 3), (1, -signal.SIGKILL)])
    killed = next(d for d in deaths if d.task == 1)
    assert "killed by SIGKILL" in killed.reason
    assert "exited with code 3" in next(d for d in deaths if d.task == 2).reason


def test_run_forked_raises_a_task_error_in_the_parent():
    def fails(send: Send) -> None:
        raise ValueError("job: nothing fits")

    with pytest.raises(ValueError, match="nothing fits"):
        run_forked([fails, fails], jobs=2, on_message=lambda t, m: None)


def _small_scenario() -> Any:
    scenario = preset_scenario("paper32")
    return replace(scenario, simulation=replace(scenario.simulation, days=0.5, seeds=2))


@pytest.mark.parametrize(("victim", "lost_after"), [("oracle", ()), ("chameleon", ("oracle",))])
def test_a_dead_simulation_is_one_line_and_the_other_results_are_kept(
        monkeypatch: pytest.MonkeyPatch, victim: str, lost_after: tuple[str, ...]) -> None:
    # The process simulating ``victim`` on seed 1 is SIGKILLed as it starts that policy.
    seed_one: list[Any] = []
    on_seed_one = [False]
    generate, run_unit, make = runner.generate_trace, runner._run_unit, runner.make_policy

    def generate_noting(*args: Any, **kwargs: Any) -> Any:
        trace = generate(*args, **kwargs)
        if kwargs["seed"] == 1:
            seed_one.append(trace)
        return trace

    def run_unit_noting(unit: Any, *args: Any) -> Any:
        on_seed_one[0] = unit.trace is seed_one[0]
        return run_unit(unit, *args)

    def make_or_die(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == victim and on_seed_one[0]:
            _die()
        return make(name, *args, **kwargs)

    monkeypatch.setattr(runner, "generate_trace", generate_noting)
    monkeypatch.setattr(runner, "_run_unit", run_unit_noting)
    monkeypatch.setattr(runner, "make_policy", make_or_die)
    names = ("chameleon", "oracle", "reroute", "restart")
    run = runner.run_scenario(_small_scenario(), policies=names, jobs=2)
    (lost,) = run.lost
    assert (lost.seed, lost.policy, lost.not_run) == (1, victim, lost_after)
    assert "killed by SIGKILL" in lost.reason
    line = lost.line()
    assert "\n" not in line and victim in line and "seed 1" in line
    seed0, seed1 = run.cells[0].runs
    assert [r.name for r in seed0.results] == list(names)
    kept = [n for n in names if n != victim and n not in lost_after]
    assert [r.name for r in seed1.results] == kept
    assert all(r.samples > 0 for r in (*seed0.results, *seed1.results))
    doc = json.loads(report_json(run))
    assert doc["lost"] == [line]
    dead = next(p for p in doc["policies"] if p["name"] == victim)
    assert dead["lost"] == [line] and len(dead["per_seed"]) == 1
    assert line in report_markdown(run)
    # every unit ran in its own process; those that finished said how much memory they took
    # (the killed one only if it lived until the parent's first look at it)
    assert len(run.process_peak_rss_bytes) == 4
    assert sum(1 for peak in run.process_peak_rss_bytes if peak > 0) >= 3


def test_results_do_not_depend_on_processes() -> None:
    names = ("chameleon", "oracle", "bamboo", "reroute", "shrink")
    alone = runner.run_scenario(_small_scenario(), policies=names, jobs=1)
    forked = runner.run_scenario(_small_scenario(), policies=names, jobs=2)
    assert report_json(alone) == report_json(forked)
    assert not forked.lost and len(forked.process_peak_rss_bytes) == 4
