"""The program format (schedule/program.py): each step kind to its wire list and back, what
each reads and defines, and every refusal of a malformed step, with its message."""

from __future__ import annotations

import pytest

from gridgraph.exec import wire
from gridgraph.schedule.program import (
    Call,
    Free,
    MalformedStep,
    Param,
    Recv,
    Return,
    Send,
    Slot,
    parse_program,
    parse_step,
    to_wire,
)
from gridgraph.trace.allowlist import OpRefused

CALL = Call(
    "aten::add.Tensor", [Slot(0), [Slot(1), 2]], {"alpha": Param(3)}, [4, 5], [[0, 4]], True
)
STEPS = [CALL, Send([4, 1], "w1"), Recv([2, 3], "w2"), Free(2), Return(5)]
WIRE = [
    ["call", "aten::add.Tensor", [Slot(0), [Slot(1), 2]], {"alpha": Param(3)}, [4, 5], [[0, 4]],
     True],
    ["send", [4, 1], "w1"],
    ["recv", [2, 3], "w2"],
    ["free", 2],
    ["return", 5],
]  # fmt: skip


@pytest.mark.parametrize("step, listed", list(zip(STEPS, WIRE)), ids=[s.kind for s in STEPS])
def test_each_step_kind_goes_to_its_wire_list_and_back(step, listed):
    assert step.wire() == listed
    assert parse_step(listed, 6) == step
    assert type(parse_step(listed, 6)) is type(step)
    # through msgpack as a run message carries it: a list is what a worker receives, the
    # same bytes as the tuples clients sent before steps had classes
    sent = wire.encode({"kind": "run", "program": to_wire([[step]])})
    assert sent == wire.encode({"kind": "run", "program": [[tuple(listed)]]})
    decoded = wire.decode(sent)["program"]
    assert decoded == [[listed]]
    assert parse_step(decoded[0][0], 6) == step


def test_a_program_goes_to_wire_and_back_with_the_params_it_uses():
    stages = [STEPS[:2], [], STEPS[2:]]
    assert to_wire(stages) == [WIRE[:2], [], WIRE[2:]]
    steps, params = parse_program(to_wire(stages), 6)
    assert steps == STEPS and params == {3}


def test_what_each_step_reads_defines_and_uses():
    assert CALL.refs() == [Slot(0), Slot(1), Param(3)]
    assert (CALL.reads(), CALL.defines(), CALL.params()) == ([0, 1], [4, 5, 4], [3])
    send, recv, free, ret = STEPS[1:]
    assert (send.reads(), send.defines(), send.params()) == ([4, 1], [], [])
    assert (recv.reads(), recv.defines(), recv.params()) == ([], [2, 3], [])
    assert (free.reads(), free.defines(), free.params()) == ([2], [], [])
    assert (ret.reads(), ret.defines(), ret.params()) == ([5], [], [])


def test_steps_print_as_a_plan_shows_them():
    assert [str(s) for s in STEPS] == [
        "%4, %5 = aten::add.Tensor(%0, [%1, 2], alpha=$3)",
        "send %4, %1 -> w1",
        "recv %2, %3 <- w2",
        "free %2",
        "return %5",
    ]


CALL_FORM = "a call step is [call, op, args, kwargs, outs, writes, report]"
REFUSED = [
    ("call", "malformed step 'call'"),
    ([], "malformed step []"),
    ([3, 1], "malformed step [3, 1]"),
    ([1, "x" * 100], "malformed step [1, '" + "x" * 75),  # shown up to 80 characters
    (["call", "aten::neg", [], {}, []], CALL_FORM),
    (["call", "aten::neg", (), {}, [], [], False], CALL_FORM),
    (["call", "aten::neg", [], [], [], [], False], CALL_FORM),
    (["call", "aten::neg", [], {1: 2}, [], [], False], CALL_FORM),
    (["call", "aten::neg", [], {}, 0, [], False], CALL_FORM),
    (["call", "aten::neg", [], {}, [], {}, False], CALL_FORM),
    (["call", "aten::neg", [Slot(6)], {}, [0], [], False],
     "step refers to Slot(index=6), beyond the program's values"),
    (["call", "aten::neg", [[Slot(0)]], {"x": [Slot(9)]}, [0], [], False],
     "step refers to Slot(index=9), beyond the program's values"),
    (["call", "aten::neg", [Slot(0)], {}, [6], [], False], "call outputs must be slots"),
    (["call", "aten::neg", [Slot(0)], {}, [-1], [], False], "call outputs must be slots"),
    (["call", "aten::neg", [Slot(0)], {}, ["1"], [], False], "call outputs must be slots"),
    (["call", "aten::neg_", [Slot(0)], {}, [1], [[0, 2]], False],
     "call writes must be [argument path, output slot] pairs"),
    (["call", "aten::neg_", [Slot(0)], {}, [1], [[-1, 1]], False],
     "call writes must be [argument path, output slot] pairs"),
    (["call", "aten::neg_", [Slot(0)], {}, [1], [[[0, "a"], 1]], False],
     "call writes must be [argument path, output slot] pairs"),
    (["call", "aten::neg_", [Slot(0)], {}, [1], [(0, 1)], False],
     "call writes must be [argument path, output slot] pairs"),
    (["call", "aten::neg_", [Slot(0)], {}, [1], [[0, 1], ["self", 1]], False],
     "a call writes more slots than it has outputs"),
    (["send", [0], "w1", 1], "a send step is [send, [slot, ...], worker]"),
    (["send", [], "w1"], "a send step is [send, [slot, ...], worker]"),
    (["recv", [True], "w1"], "a recv step is [recv, [slot, ...], worker]"),
    (["recv", [0], 1], "a recv step is [recv, [slot, ...], worker]"),
    (["send", [6], "w1"], "send of a slot beyond the program's values"),
    (["recv", [-1], "w1"], "recv of a slot beyond the program's values"),
    (["recv", [1, 1], "w1"], "a recv step names a slot twice"),
    (["free"], "a free step is [free, slot]"),
    (["free", 6], "a free step is [free, slot]"),
    (["return", -1], "a return step is [return, slot]"),
    (["return", 1.0], "a return step is [return, slot]"),
    (["jump", 0], "unknown step kind 'jump'"),
]  # fmt: skip


@pytest.mark.parametrize("step, message", REFUSED)
def test_a_malformed_step_is_refused_saying_why(step, message):
    with pytest.raises(MalformedStep) as refused:
        parse_step(step, 6)
    assert str(refused.value) == message


def test_a_program_that_is_not_stages_of_steps_is_refused():
    for program in (["free", 0], {"steps": []}, [[], "x"], [("free", 0)]):
        with pytest.raises(MalformedStep, match="a program is a list of stages"):
            parse_program(program, 1)


def test_a_call_of_an_op_off_the_allowlist_is_refused_before_its_slots_are_read():
    with pytest.raises(OpRefused, match="not an ATen op name"):
        parse_step(["call", "os.system", [Slot(99)], {}, [0], [], False], 1)
    with pytest.raises(OpRefused, match="allowlist"):
        parse_step(["call", "aten::_nope", [], {}, [0], [], False], 1)
