"""Starvation search (DESIGN §4 item 11) on an explored state graph.

A request starves if some run of the system keeps it waiting forever while the
executor keeps making progress for others. Within a finite explored graph
that is a reachable cycle along which one request is waiting in every state
(a request admitted and preempted by the same plan never ran, so it counts as
waiting) and at least one move produces tokens or finishes a request.

The search follows one waiting request through renamings: its nodes are pairs
(state, position of the request in that state's canonical order), its edges
the environment's benign moves (arrivals, plans, results; never aborts,
failures or executor loss) that leave that request waiting. A strongly
connected component of this graph that contains a progress edge is a
starvation cycle; it is reported as a lasso (a path to the cycle, then the
cycle), replayed on the real core to make sure it is not an artefact of the
state abstraction.
"""

from __future__ import annotations

from collections import deque

import attrs

from .explore import Exploration, Move, apply_move, canonical_key, replay, scope_patches, _call

BENIGN = frozenset({"add", "step", "schedule", "complete"})


@attrs.define
class Starvation:
    """A starvation lasso: `prefix` reaches a state where `request_id` waits, and
    repeating `loop` keeps it waiting while others make progress."""

    policy: str
    request_id: str
    prefix: list[Move]
    loop: list[Move]
    confirmed: bool
    code: str

    def __str__(self) -> str:
        kind = "confirmed on the real core" if self.confirmed else "NOT reproduced on the real core"
        return (f"{self.policy}: {self.request_id} waits forever ({kind}); "
                f"{len(self.prefix)} moves to the cycle, {len(self.loop)} in it\n\n{self.code}")


@attrs.define
class LivenessResult:
    """What the starvation search examined and found."""

    num_nodes: int
    num_edges: int
    num_components: int
    starvation: Starvation | None

    @property
    def starves(self) -> bool:
        """Whether a starvation cycle was found."""
        return self.starvation is not None


def find_starvation(ex: Exploration, loops_to_confirm: int = 3) -> LivenessResult:
    """Search `ex` (explored with `keep_graph=True`) for a starvation cycle."""
    # Node base[state] + i stands for (state, waiting request at position i).
    base, owner, total = [], [], 0
    for state, (n_run, n_live) in enumerate(zip(ex.num_running, ex.num_live)):
        base.append(total - n_run)
        owner.extend((state, i) for i in range(n_run, n_live))
        total += n_live - n_run
    adj: list[list[tuple[int, int]]] = [[] for _ in range(total)]
    num_edges = 0
    for e_index, (src, dst, move, progress, rename) in enumerate(ex.edges):
        if move[0] not in BENIGN:
            continue
        dst_run = ex.num_running[dst]
        for i in range(ex.num_running[src], ex.num_live[src]):
            j = rename[i]
            if j >= dst_run:
                adj[base[src] + i].append((base[dst] + j, e_index))
                num_edges += 1
    comp = _tarjan(adj)
    num_components = max(comp) + 1 if comp else 0
    for u in range(total):
        for v, e_index in adj[u]:
            if comp[u] == comp[v] and ex.edges[e_index][3]:
                starv = _lasso(ex, adj, comp, owner, u, v, e_index, loops_to_confirm)
                return LivenessResult(total, num_edges, num_components, starv)
    return LivenessResult(total, num_edges, num_components, None)


def _tarjan(adj: list[list[tuple[int, int]]]) -> list[int]:
    """Strongly connected components, iteratively; returns each node's component."""
    n = len(adj)
    index = [-1] * n
    low = [0] * n
    on_stack = [False] * n
    comp = [-1] * n
    stack: list[int] = []
    counter = 0
    num_comp = 0
    for root in range(n):
        if index[root] != -1:
            continue
        work = [(root, 0)]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack[root] = True
        while work:
            node, k = work[-1]
            edges = adj[node]
            if k < len(edges):
                work[-1] = (node, k + 1)
                nxt = edges[k][0]
                if index[nxt] == -1:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack[nxt] = True
                    work.append((nxt, 0))
                elif on_stack[nxt] and index[nxt] < low[node]:
                    low[node] = index[nxt]
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                if low[node] < low[parent]:
                    low[parent] = low[node]
            if low[node] == index[node]:
                while True:
                    w = stack.pop()
                    on_stack[w] = False
                    comp[w] = num_comp
                    if w == node:
                        break
                num_comp += 1
    return comp


def _lasso(ex, adj, comp, owner, u, v, e_index, loops_to_confirm) -> Starvation:
    # Shortest way back from v to u inside the component.
    target = comp[u]
    back = {v: None}
    queue = deque([v])
    while queue and u not in back:
        x = queue.popleft()
        for y, ei in adj[x]:
            if comp[y] == target and y not in back:
                back[y] = (x, ei)
                queue.append(y)
    loop_edges = []
    x = u
    while x != v:
        x, ei = back[x]
        loop_edges.append(ei)
    loop = [ex.edges[e_index][2]] + [ex.edges[ei][2] for ei in reversed(loop_edges)]
    state, position = owner[u]
    prefix = ex.path_to(state)
    with scope_patches(ex.scope):
        return _confirm(ex, prefix, loop, position, loops_to_confirm)


def _confirm(ex: Exploration, prefix, loop, position, loops) -> Starvation:
    """Replay the lasso on the real core; the request must wait through every loop
    and each loop must come back to the same canonical state."""
    h, lines = replay(ex, prefix, checked=False)
    horizon = ex.scope.horizon(ex.config)
    key, names = canonical_key(h, horizon)
    rid = names[position]
    confirmed = True
    body = []
    for n in range(loops):
        body.append(f"    # loop {n + 1}")
        for move in loop:
            _, names = canonical_key(h, horizon)
            body.append(f"    {_call(h, move, names, ex.scope)}")
            apply_move(h, move, names, ex.scope)
            if h.state_of(rid) != "pending":
                confirmed = False
        body.append(f"    assert h.state_of({rid!r}) == 'pending'")
        if canonical_key(h, horizon)[0] != key:
            confirmed = False
    name = ex.policy.replace("-", "_").replace(":", "_").replace(".", "_")
    code = "\n".join([
        "from cadence.statemachine.config import CacheConfig, SchedulerConfig",
        "from cadence.spec.harness import Harness",
        "",
        "",
        f"def test_{name}_starves_{rid}():",
        f'    """{rid} waits through every loop while the others keep finishing."""',
        f"    h = Harness({ex.config!r}, {ex.cache_config!r})",
        *[f"    {line}" for line in lines],
        f"    assert h.state_of({rid!r}) == 'pending'",
        *body,
        "",
    ])
    return Starvation(ex.policy, rid, prefix, loop, confirmed, code)
