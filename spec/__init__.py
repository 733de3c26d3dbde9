"""The formal side of Cadence: checks that run against the real scheduling core.

- `reference`: a naive executable spec of scheduling and block accounting, and
  the abstraction function from `cadence.statemachine.scheduler.Scheduler`;
- `invariants`: DESIGN §4 as named predicates (state, plan, transition, trace);
- `explore` and `liveness`: exhaustive exploration at small scope, with
  refinement checked on every move, and a starvation search;
- `stateful`: Hypothesis state machines, parameterised by configuration and policy;
- `trace`: validation of recorded engine traces against the spec;
- `check`: the `cadence check` command;
- `admission.pml`, `admission_broken.pml`: SPIN models of admission with aging.

See spec/README.md for what is checked at which scope.
"""

from .explore import SCOPES, Exploration, Scope, Shape, explore
from .harness import Harness
from .liveness import LivenessResult, Starvation, find_starvation
from .reference import Abstraction, ReferenceSpec, RefRequest, RefState
from .refinement import CheckedHarness, SpecViolation, StepChecker
from .trace import TraceRecorder, TraceViolation, load_trace, record_trace, validate_trace

__all__ = [
    "SCOPES", "Exploration", "Scope", "Shape", "explore",
    "Harness", "CheckedHarness", "SpecViolation", "StepChecker",
    "LivenessResult", "Starvation", "find_starvation",
    "Abstraction", "ReferenceSpec", "RefRequest", "RefState",
    "TraceRecorder", "TraceViolation", "load_trace", "record_trace", "validate_trace",
]
