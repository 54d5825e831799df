"""Point-to-point traffic correct by construction under NCCL's semantics
(runtime/traffic.py, runtime/nccl_model.py, docs/design.md section 4).

The checker runs the workers' own programs (``traffic.step_program``, what the executor
performs; ``traffic.migration_program``, what the migration performs;
``traffic.warm_up_program``, what the group warm-up performs) on a model of NCCL: in-order
matching per pair and communicator, one stream per pair and communicator with both
directions on it, sends complete only when matched. It passes on every plan the runtime
can run (generated; the multi-process tests' plans, reconstructed with the planner), and
fails on each construction that breaks NCCL's rules: one shared world group (the 1F1B
deadlock of the issue), receives posted in the receiver's own order (the wrong
micro-batch taken when two logical streams share a pair), one message swapped, the
old warm-up.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

import pytest
from p2p_plans import (
    TOPOLOGY,
    Case,
    generated,
    planner_decisions,
    profile_of,
    schedule_actions,
    tiny_decisions,
)
from rerouted_step import FULLY_REROUTED, fully_rerouted_plan

from chameleon_ft.perf import build_schedule
from chameleon_ft.plan import ExecutionPlan, Pipeline, Stage
from chameleon_ft.plan.plan import Reroute
from chameleon_ft.runtime.nccl_model import (
    NcclModel,
    check_directive,
    check_migration,
    check_programs,
    check_step,
    check_warm_up,
    compare_pairs,
    migration_programs,
    step_programs,
)
from chameleon_ft.runtime.traffic import (
    DOWN,
    UP,
    Action,
    Do,
    Instruction,
    Kind,
    Message,
    actions_of,
    channel_of,
    directive_ops,
    step_program,
)

NUM_GENERATED = 1200


def _one_group(src: int, dst: int) -> int:
    """The old construction: every message on the one world group."""
    return 0


def receiver_order(program: Sequence[Instruction]) -> tuple[Instruction, ...]:
    """The program with each receive posted where the receiver needs it (its own order),
    the way the executor posted them before."""
    out: list[Instruction] = []
    for ins in program:
        if ins.do is Do.POST_RECV:
            continue
        if ins.do is Do.WAIT_RECV:
            out.append(Instruction(Do.POST_RECV, ins.message))
        out.append(ins)
    return tuple(out)


def _stages(first: int, second: int, m: int) -> Pipeline:
    return Pipeline((Stage(first, 0, 2), Stage(second, 2, 4)), m)


def two_by_two(m: int, reroutes: tuple[Reroute, ...] = (), schedule: str = "1f1b"
               ) -> ExecutionPlan:
    """dp 2 x pp 2 over layers 0-1 and 2-3: pipeline 0 on workers 0, 1; pipeline 1 on
    workers 2, 3."""
    return ExecutionPlan(num_layers=4, pipelines=(_stages(0, 1, m), _stages(2, 3, m)),
                         reroutes=reroutes, schedule=schedule)


def one_f_one_b(plan: ExecutionPlan) -> dict[int, tuple[Action, ...]]:
    """Each stage's plain 1F1B order (no reroutes)."""
    out: dict[int, tuple[Action, ...]] = {}
    for p, pipe in enumerate(plan.pipelines):
        n, m = pipe.num_stages, pipe.num_microbatches
        for s, st in enumerate(pipe.stages):
            warm = min(n - s, m)
            order: list[Action] = [("F", p, s, j) for j in range(warm)]
            for j in range(m):
                order.append(("B", p, s, j))
                if warm + j < m:
                    order.append(("F", p, s, warm + j))
            out[st.worker] = tuple(order)
    return out


# ---------------------------------------------------------------------- the rule itself
def test_the_issues_1f1b_deadlock_on_one_shared_group_and_none_on_two() -> None:
    """Stage 0 queues [send a0, send a1, recv g0], stage 1 [recv a0, send g0, recv a1]:
    on one stream per pair both wait on a send; one group per direction cannot."""
    plan = two_by_two(4)
    programs = step_programs(plan, one_f_one_b(plan))
    assert check_programs(programs) == []
    findings = check_programs(programs, channel=_one_group)
    assert len(findings) == 1 and findings[0].startswith("deadlock:"), findings
    assert "worker 0 at" in findings[0] and "send activation (0, 1, 1) 0->1" in findings[0]


def fully_rerouted() -> ExecutionPlan:
    plan = fully_rerouted_plan()
    assert plan == two_by_two(3, (Reroute(0, 0, ((2, 3),)), Reroute(0, 1, ((3, 3),))))
    return plan


def test_a_receiver_posting_in_its_own_order_takes_another_microbatch() -> None:
    plan = fully_rerouted()
    programs = step_programs(plan, FULLY_REROUTED)
    assert check_programs(programs) == []
    # worker 3 needs pipeline 0's micro-batch 2 third; worker 2 sent pipeline 1's
    # micro-batch 0 third: posted in the sender's order, the receive is there already
    third = [ins.message for ins in programs[3] if ins.do is Do.POST_RECV][:4]
    assert [m.key for m in third if m is not None] == [(0, 1, 0), (0, 1, 1), (1, 1, 0),
                                                       (1, 1, 1)]
    naive = {w: receiver_order(p) for w, p in programs.items()}
    findings = check_programs(naive)
    assert "pair 2->3: message #2 sent is activation (1, 1, 0) 2->3, the receive posted " \
           "is for activation (0, 1, 2) 2->3" in findings
    assert "worker 3's receive posted for activation (0, 1, 2) 2->3 got activation " \
           "(1, 1, 0) 2->3" in findings  # same shape: NCCL would not notice


def test_one_message_swapped_fails_both_checks() -> None:
    """Two receives worker 3 posts together (pipeline 1's micro-batches 0 and 1, before
    pipeline 0's micro-batch 2) in the other order."""
    plan = fully_rerouted()
    programs = dict(step_programs(plan, FULLY_REROUTED))
    program = list(programs[3])
    first = next(i for i, (a, b) in enumerate(itertools.pairwise(program))
                 if a.do is b.do is Do.POST_RECV)
    program[first], program[first + 1] = program[first + 1], program[first]
    programs[3] = tuple(program)
    assert compare_pairs(programs) == [
        "pair 2->3: message #2 sent is activation (1, 1, 0) 2->3, the receive posted is for "
        "activation (1, 1, 1) 2->3"]
    assert NcclModel(programs).run() == [
        "worker 3's receive posted for activation (1, 1, 1) 2->3 got activation (1, 1, 0) 2->3",
        "worker 3's receive posted for activation (1, 1, 0) 2->3 got activation (1, 1, 1) 2->3"]


def test_a_shape_or_dtype_that_differs_is_a_finding() -> None:
    plan = two_by_two(2)
    boundaries = [[[2, 8], "float64"]] * 4
    programs = dict(step_programs(plan, one_f_one_b(plan), boundaries))
    assert check_programs(programs) == []
    # worker 1 receives into float32 buffers what worker 0 sends as float64
    wrong = [Instruction(ins.do, replace(ins.message, dtype="float32"))
             if ins.message is not None and ins.message.dst == 1 else ins
             for ins in programs[1]]
    programs[1] = tuple(wrong)
    findings = check_programs(programs)
    assert findings[0] == ("pair 0->1: message #0 sent is activation (0, 1, 0) 0->1 [2, 8] "
                           "float64, the receive posted is for activation (0, 1, 0) 0->1 "
                           "[2, 8] float32")
    assert len(findings) == 3 and "got activation (0, 1, 1)" in findings[2], findings


def test_messages_carry_the_boundary_they_cross() -> None:
    plan = ExecutionPlan(num_layers=5, pipelines=(Pipeline(
        (Stage(4, 0, 1), Stage(1, 1, 4), Stage(0, 4, 5)), 1),))
    boundaries = [[[2, 3, 8], "bfloat16"], [[2, 3, 8], "bfloat16"], [[2, 3, 8], "bfloat16"],
                  [[2, 3, 9], "bfloat16"], [[2, 256], "float32"]]
    program = step_program(plan, one_f_one_b(plan), 1, boundaries)
    got = [(ins.do, ins.message) for ins in program if ins.message is not None]
    assert got == [
        (Do.POST_RECV, Message(Kind.ACTIVATION, 4, 1, (0, 1, 0), 1, (2, 3, 8), "bfloat16")),
        (Do.WAIT_RECV, Message(Kind.ACTIVATION, 4, 1, (0, 1, 0), 1, (2, 3, 8), "bfloat16")),
        (Do.POST_SEND, Message(Kind.ACTIVATION, 1, 0, (0, 2, 0), 4, (2, 3, 9), "bfloat16")),
        (Do.POST_RECV, Message(Kind.GRADIENT, 0, 1, (0, 1, 0), 4, (2, 3, 9), "bfloat16")),
        (Do.WAIT_RECV, Message(Kind.GRADIENT, 0, 1, (0, 1, 0), 4, (2, 3, 9), "bfloat16")),
        (Do.POST_SEND, Message(Kind.GRADIENT, 1, 4, (0, 0, 0), 1, (2, 3, 8), "bfloat16"))]
    assert channel_of(4, 1) == DOWN and channel_of(1, 4) == UP


def test_inconsistent_action_lists_are_refused() -> None:
    plan = two_by_two(2)
    actions = dict(one_f_one_b(plan))
    actions[1] = actions[1][:-1]  # worker 1 never runs B(0, 1, 1): worker 0 waits for ever
    with pytest.raises(ValueError, match="worker 0 waits for gradient"):
        step_program(plan, actions, 0)
    actions = dict(one_f_one_b(plan))
    actions[1] = tuple(a for a in actions[1] if a != ("F", 0, 1, 1))
    with pytest.raises(ValueError, match="which worker 1 never takes"):
        step_program(plan, actions, 1)
    assert check_step(plan, actions)[0].startswith("ops:")
    with pytest.raises(ValueError, match="ops: worker 3 has a 'W' operation"):
        actions_of({"3": [["W", 0, 1, 0]]})


# ---------------------------------------------------------------------- every plan
def _checked(case: Case) -> list[str]:
    actions = schedule_actions(case.plan, case.profile)
    findings = check_step(case.plan, actions)
    if case.migration is not None and case.migration.transfers:
        findings += check_migration(_transfers(case.migration), case.migration.rounds)
    return findings


def _transfers(migration: object) -> list[list[int]]:
    return [[t.layer, t.src, t.dst, t.part, t.num_parts]
            for t in migration.transfers]  # type: ignore[attr-defined]


def test_every_generated_plan_passes() -> None:
    """1,200 generated plans: uniform, heterogeneous (pipelines of different lengths and
    micro-batch counts), rerouted (one or several dead stages, over one or several
    peers), half on scattered ids (spares in the slots), under ``1f1b`` and ``gpipe``."""
    start = time.perf_counter()
    kinds: dict[str, int] = {}
    for seed in range(NUM_GENERATED):
        case = generated(seed)
        assert _checked(case) == [], case.name
        kind = case.name.split("-")[1]
        kinds[kind] = kinds.get(kind, 0) + 1
        if len(case.plan.reroutes) > 1:
            kinds["several dead"] = kinds.get("several dead", 0) + 1
    assert min(kinds.values()) >= 50, kinds
    assert time.perf_counter() - start < 60


def test_the_multi_process_tests_plans_pass() -> None:
    """Every plan the recovery tests run (tests/dist), as the planner makes them on
    their job, with its migration, in the directive's JSON form."""
    seen = 0
    for case in tiny_decisions():
        actions = schedule_actions(case.plan, case.profile)
        directive = {"plan": case.plan.to_dict(), "ops": directive_ops_of(actions),
                     "world": sorted(set(case.plan.workers) | _movers(case)),
                     "migration": None}
        if case.migration is not None and case.migration.transfers:
            directive["migration"] = {"transfers": _transfers(case.migration),
                                      "rounds": [list(r) for r in case.migration.rounds]}
        assert check_directive(directive) == [], case.name
        seen += 1
    assert seen >= 100


def directive_ops_of(actions: Mapping[int, Sequence[Action]]) -> dict[str, list[list[object]]]:
    return {str(w): [list(a) for a in seq] for w, seq in actions.items()}


def _movers(case: Case) -> set[int]:
    if case.migration is None:
        return set()
    return {t.src for t in case.migration.transfers} | {t.dst for t in case.migration.transfers}


def test_the_planners_decisions_pass() -> None:
    """100 decisions of every runtime policy after random deaths, once or twice in a row,
    on two 8-worker jobs with a spare node: re-plans with pipelines of different lengths,
    reroutes, swaps onto spares, with their migrations."""
    heterogeneous = rerouted = 0
    for case in planner_decisions(100):
        assert _checked(case) == [], case.name
        heterogeneous += len({pipe.num_stages for pipe in case.plan.pipelines}) > 1
        rerouted += bool(case.plan.reroutes)
    assert heterogeneous >= 5 and rerouted >= 5, (heterogeneous, rerouted)


def test_the_directive_form_is_the_schedules() -> None:
    case = generated(3)
    ops = directive_ops(build_schedule(case.plan, case.profile, TOPOLOGY).ops)
    assert actions_of(ops) == schedule_actions(case.plan, case.profile)


def test_receiving_in_the_receivers_order_is_caught_on_generated_plans() -> None:
    """The deliberately broken executor (each receive posted where its action needs it):
    the checker finds a wrong match on rerouted plans, on the plans' own action lists."""
    caught = 0
    for seed in range(300):
        case = generated(seed)
        programs = step_programs(case.plan, schedule_actions(case.plan, case.profile))
        findings = check_programs({w: receiver_order(p) for w, p in programs.items()})
        if findings:
            caught += 1
            assert case.plan.reroutes, case.name  # a pair carries two streams only then
            assert any(" got " in f for f in findings), findings
    assert caught >= 5


def test_one_group_for_both_directions_deadlocks_on_generated_plans() -> None:
    deadlocked = 0
    for seed in range(100):
        case = generated(seed)
        programs = step_programs(case.plan, schedule_actions(case.plan, case.profile))
        if any(f.startswith("deadlock") for f in check_programs(programs, channel=_one_group)):
            deadlocked += 1
    assert deadlocked >= 20


# ---------------------------------------------------------------------- migration
def random_migration(rng: random.Random) -> tuple[list[list[int]], list[list[int]]]:
    """Transfers between up to 5 workers, layers split in up to 3 parts, in rounds where
    a worker may send and receive, to and from the same peer, several times."""
    transfers: list[list[int]] = []
    for layer in range(rng.randint(1, 6)):
        parts = rng.randint(1, 3)
        dst = rng.randrange(5)
        for part in range(parts):
            src = rng.choice([w for w in range(5) if w != dst])
            transfers.append([layer, src, dst, part, parts])
    order = list(range(len(transfers)))
    rng.shuffle(order)
    cuts = sorted(rng.sample(range(1, len(order)), rng.randint(0, len(order) - 1))) \
        if len(order) > 1 else []
    rounds = [order[a:b] for a, b in zip([0, *cuts], [*cuts, len(order)], strict=True)]
    return transfers, rounds


def test_random_migrations_pass() -> None:
    rng = random.Random(7)
    for _ in range(300):
        transfers, rounds = random_migration(rng)
        assert check_migration(transfers, rounds) == [], (transfers, rounds)


def test_a_round_where_both_workers_of_a_pair_send_and_receive() -> None:
    transfers = [[0, 1, 2, 0, 1], [1, 2, 1, 0, 1], [2, 1, 2, 0, 1], [3, 2, 1, 0, 1]]
    rounds = [[0, 1, 2, 3]]
    programs = migration_programs(transfers, rounds)
    assert check_programs(programs) == []
    # the receiver waits for each length: sizes and slices in the sender's order
    assert [(ins.do, ins.message.kind, ins.message.key[0]) for ins in programs[2]
            if ins.message is not None] == [
        (Do.POST_RECV, Kind.STATE_SIZE, 0), (Do.WAIT_RECV, Kind.STATE_SIZE, 0),
        (Do.POST_RECV, Kind.STATE_BYTES, 0),
        (Do.POST_SEND, Kind.STATE_SIZE, 1), (Do.POST_SEND, Kind.STATE_BYTES, 1),
        (Do.POST_RECV, Kind.STATE_SIZE, 2), (Do.WAIT_RECV, Kind.STATE_SIZE, 2),
        (Do.POST_RECV, Kind.STATE_BYTES, 2),
        (Do.POST_SEND, Kind.STATE_SIZE, 3), (Do.POST_SEND, Kind.STATE_BYTES, 3)]
    swapped = dict(programs)
    program = list(swapped[2])
    program[0], program[2] = program[2], program[0]  # the slice's receive before the length's
    swapped[2] = tuple(program)
    assert check_programs(swapped)


# ---------------------------------------------------------------------- warm-up
@pytest.mark.parametrize("world", [[0], [0, 1], [0, 1, 2], list(range(8)), [1, 4, 5, 9, 12]])
def test_the_warm_up_opens_every_pair_without_deadlock(world: list[int]) -> None:
    assert check_warm_up(world) == []


def test_the_old_warm_up_deadlocks_under_nccl() -> None:
    """Every worker sent to each peer, then received from it, on one group: each pair's
    stream holds two sends at its heads. Two groups with the sends first everywhere
    deadlock at the pairs' communicators instead."""
    world = [0, 1, 2]

    def old(worker: int, sends_first_on_both: bool) -> tuple[Instruction, ...]:
        program = []
        for peer in world:
            if peer != worker:
                program += [Instruction(Do.POST_SEND, Message(Kind.WARM_UP, worker, peer)),
                            Instruction(Do.POST_RECV, Message(Kind.WARM_UP, peer, worker))]
        return (*program, Instruction(Do.WAIT_ALL))

    one_group = check_programs({w: old(w, False) for w in world}, channel=_one_group,
                               open_pairs=False)
    assert one_group and one_group[0].startswith("deadlock"), one_group
    two_groups = check_programs({w: old(w, True) for w in world}, open_pairs=False)
    assert two_groups and two_groups[0].startswith("deadlock"), two_groups


def test_the_checker_is_fast_enough_for_a_debug_assertion() -> None:
    """A step of 64 workers (dp 8 x pp 8, 16 micro-batches each, two stages rerouted)."""
    pipelines = tuple(Pipeline(tuple(Stage(s * 8 + p, s, s + 1) for s in range(8)), 16)
                      for p in range(8))
    plan = ExecutionPlan(num_layers=8, pipelines=pipelines,
                         reroutes=(Reroute(0, 3, ((25, 8), (26, 8))),
                                   Reroute(5, 6, ((48, 16),))))
    plan.validate()
    actions = schedule_actions(plan, profile_of(8, 0))
    start = time.perf_counter()
    assert check_step(plan, actions) == []
    assert time.perf_counter() - start < 5.0
