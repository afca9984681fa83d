"""Multi-turn episodes: the host side of the turn loop that `rollout.engine` runs when its
`SamplingSettings` have `turns`. The model's turn ends at a stop token or a stop sequence, the
environment answers in a host callback, its observation joins the same sequence and the
model's next turn follows it.

    settings = SamplingSettings(..., turns=TurnSettings(stop_sequences=(tuple(
        tok.encode("</calc>")),), max_turns=4))
    out = sampler(actor, prompt_ids, prompt_mask, key, settings, on_turn_end=env)
    # env(rows, turn_tokens) -> [None | [ids], ...], or a `TurnService` (asynchronous)
    # out.episodes: `Episodes`

The response of row b is one contiguous run of N = `max_new_tokens` columns: action tokens,
then observation tokens, then action tokens ... then padding. `response_mask` stays a prefix
mask, 1 through the last written token, since the forward passes read token t's log-prob at
position P - 1 + t (`rollout.forward`). `action_mask` marks the drawn tokens only:
observations are context, not actions, so their KL, losses and advantages are masked out.
verl's multi-turn rollout does the same (`AsyncRolloutRequest` in
`verl/workers/rollout/schemas.py` appends tool responses with `loss_mask` 0), as does
OpenRLHF's `MultiTurnExecutor` (`action_ranges` over the drawn spans in
`openrlhf/utils/agent.py`).

The turn loop (`TurnLoop`): a slot whose drawn token ends a turn (a stop token, or the last
token of a stop sequence inside the turn) is done for the rest of its decode chunk and keeps
its slot and its pages: it **waits**. At the chunk boundary the host hands the new turn to the
environment (`TurnService.submit`: it starts the step and returns) and goes on: the next decode
chunks run every other live slot, and at each boundary the answers that are ready are taken in
(`TurnService.ready`), whenever they come. For each answer:

- None, or the row's `max_turns`-th turn: the episode ends; its slot and pages come free.
- an observation of m tokens that leaves a column for an action: the slot's pages grow by what
  m + 1 fed tokens need, and the engine feeds the turn's last token and the observation into
  its pages (a chunked prefill at the slot's own positions: the history is never re-encoded)
  and draws its next turn's first token; the slot decodes in the next chunk.
- an observation that reaches the budget: written as it is, cut to the budget, and the row
  ends (not `ended`: the budget cut it).

So a slow environment step holds its own slot, never the others: they decode, finish and are
refilled around it. When every live slot waits and no group can be admitted, the host blocks
in `TurnService.wait` instead of running empty chunks. A plain callable `on_turn_end(rows,
turns) -> answers` is a service whose answers are ready at once (`CallbackTurns`).

Timing cannot change the tokens: token t of row b is drawn with the key (step key, b, t)
(`rollout.draws`), and an observation is fed at the row's own positions, so an answer taken in
one chunk later gives the same tokens (log-probs to float rounding: the chunk's slots differ).

Several processes: every process runs the schedulers of every replica on the same replicated
values, so all of them run the same device programs in the same order. Each process hands
over only the turns of the rows it owns (`parallel.host.owned_rows`: its row blocks, each
block owned by one process) and reads only its own rows' tokens; at each boundary with turns
pending, the ready answers of every process are exchanged (`exchange`, an all-gather of
`(row, turn's last token, observation)`) and applied in row order, so every process takes the
same decisions: which slots resume, which pages they take. The set of pending slots is known
to all (the replicated `waiting` flags and the exchanged answers), so all processes agree on
when to exchange.

Why wait rather than give the slot up: a freed slot would be refilled and the episode
re-admitted by re-encoding its whole history. Waiting sequences are never preempted: a
multi-turn engine's pool holds every slot's longest sequence (`engine_layout.engine_layout`),
since a preempted episode could not be recomputed without asking its environment again. The
observation columns are not written on the devices: the host knows them and writes them into
the final arrays with the action mask (0 there): `episodes_of`.

Token t of row b is drawn with the single-turn key (`rollout.draws`), so a row whose first turn
is its last has the single-turn tokens and log-probs up to its turn end.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, NamedTuple, Optional, Protocol, Sequence

import numpy as np

from ppo_jax.rollout.draws import SamplingSettings, TurnSettings
from ppo_jax.rollout.static_batch import check_settings, int_setting, token_id

# on_turn_end(rows, turn_tokens) -> one answer per row: None (the episode ends) or observation ids
TurnCallback = Callable[[list, list], Sequence[Optional[Sequence[int]]]]


class Episodes(NamedTuple):
    """The multi-turn part of a `draws.Generation` of B rows over N columns.

    action_mask `[B, N]` int32 (device): 1 on drawn tokens, 0 on observation tokens and padding.
    turns `[B]` int32: assistant turns taken (the ended ones, plus one cut by the budget).
    turn_ends: per row, the response columns where its turns ended (where `on_turn_end` was
      called).
    ended `[B]` bool: the episode ended at a turn end (the environment answered None, or
      max_turns); False when the budget N cut it (a turn, or an observation, that did not fit).
    """

    action_mask: object
    turns: np.ndarray
    turn_ends: tuple[tuple[int, ...], ...]
    ended: np.ndarray


def checked_settings(settings: SamplingSettings, cfg, prompt_width: int) -> SamplingSettings:
    """`settings` checked for a model config and a prompt width, normalised (ints, floats,
    tuples). Raises ValueError naming the field and its value (`static_batch.check_settings`
    for the sampling fields; a stop sequence that is empty or not token ids; max_turns < 1)."""
    if not isinstance(settings, SamplingSettings):
        raise ValueError(f"settings must be a SamplingSettings, got {type(settings).__name__}")
    s = settings
    base = check_settings(cfg, prompt_width, s.max_new_tokens, s.temperature, s.top_k, s.top_p,
                          s.greedy, s.stop_token_ids, s.pad_token_id, None)
    base.pop("cache_dtype")
    if s.turns is None:
        return replace(s, **base)
    if not isinstance(s.turns, TurnSettings):
        raise ValueError(f"turns must be a TurnSettings or None, got {type(s.turns).__name__}")
    seqs = s.turns.stop_sequences
    if isinstance(seqs, (str, bytes)) or not hasattr(seqs, "__iter__"):
        raise ValueError(f"stop_sequences={seqs!r} must be a sequence of token-id sequences")
    normal = []
    for i, seq in enumerate(seqs):
        if isinstance(seq, (str, bytes)) or not hasattr(seq, "__iter__"):
            raise ValueError(f"stop_sequences[{i}]={seq!r} must be a sequence of token ids "
                             "(tokenize the text first)")
        seq = tuple(token_id(f"stop_sequences[{i}]", t, cfg.vocab_size) for t in seq)
        if not seq:
            raise ValueError(f"stop_sequences[{i}] is empty: a stop sequence needs a token")
        normal.append(seq)
    turns = TurnSettings(tuple(normal), int_setting("max_turns", s.turns.max_turns, 1))
    return replace(s, **base, turns=turns)


def _observation(row: int, answer, vocab_size: int) -> Optional[list[int]]:
    """One answer of `on_turn_end`: None, or a list of token ids (ValueError naming the row)."""
    if answer is None:
        return None
    if isinstance(answer, np.ndarray) and answer.ndim == 1:
        answer = answer.tolist()
    if not isinstance(answer, (list, tuple)):
        raise ValueError(f"on_turn_end's answer for row {row} must be None (the episode ends) or "
                         f"a list of token ids, got {type(answer).__name__}: {answer!r:.80}")
    return [token_id(f"on_turn_end's answer for row {row}", t, vocab_size) for t in answer]


class TurnService(Protocol):
    """The environment side of the turn loop, asynchronous: the engine hands it turns as they
    end and takes the answers that are ready at each chunk boundary.

    submit(rows, turns): start the environment's answer to each row's turn (global batch
      rows, each turn a list of token ids); called once per turn, only for the rows this
      process owns (`parallel.host.owned_rows`); must not block on the environment.
    ready() -> {row: None | observation ids}: the answers finished since the last call (None:
      the episode ends, a failed step included), each handed out once.
    wait(timeout_s): block until an answer is ready or `timeout_s` passes; called when every
      live slot waits for its environment.
    """

    def submit(self, rows: list[int], turns: list[list[int]]) -> None: ...

    def ready(self) -> dict[int, Optional[Sequence[int]]]: ...

    def wait(self, timeout_s: Optional[float]) -> None: ...


class CallbackTurns:
    """A plain `on_turn_end(rows, turns) -> answers` as a `TurnService`: called at `submit`, its
    answers ready at once (a synchronous environment: tests, scripted callers).

    Raises (from `submit`):
      ValueError: the callback did not return one answer per row.
    """

    def __init__(self, on_turn_end: TurnCallback):
        self.on_turn_end, self.answers = on_turn_end, {}

    def submit(self, rows: list[int], turns: list[list[int]]) -> None:
        answers = self.on_turn_end(rows, turns)
        if isinstance(answers, (str, bytes)) or not hasattr(answers, "__len__") or \
                len(answers) != len(rows):
            n = len(answers) if hasattr(answers, "__len__") else type(answers).__name__
            raise ValueError(f"on_turn_end must return one answer per row ({len(rows)} rows: "
                             f"{rows}), got {n}")
        self.answers.update(zip(rows, answers))

    def ready(self) -> dict:
        out, self.answers = self.answers, {}
        return out

    def wait(self, timeout_s: Optional[float]) -> None:
        return None


def turn_service(on_turn_end) -> TurnService:
    """`on_turn_end` as a `TurnService`: itself when it has `submit`, `ready` and `wait`, else
    a callable wrapped in `CallbackTurns`.

    Raises:
      ValueError: neither a service nor callable.
    """
    if all(callable(getattr(on_turn_end, m, None)) for m in ("submit", "ready", "wait")):
        return on_turn_end
    if not callable(on_turn_end):
        raise ValueError(f"on_turn_end={on_turn_end!r}: a multi-turn engine (settings with "
                         "turns) needs a callable or a TurnService")
    return CallbackTurns(on_turn_end)


class TurnRecord:
    """The host's record of B rows: turn ends (response columns), whether a turn end ended the
    episode, the current turn's first column, and the observations written `(column, ids)`."""

    def __init__(self, batch: int):
        self.turn_ends = [[] for _ in range(batch)]
        self.ended = np.zeros(batch, bool)
        self.turn_start = np.zeros(batch, np.int64)
        self.observations = [[] for _ in range(batch)]


class TurnLoop:
    """The host side of one batch's turn loop (module doc), the same on every process.

    Args:
      batch, rows_per_replica: B rows, B / R per replica.
      settings: the checked `SamplingSettings` (with turns).
      service: the `TurnService`.
      owned: `(start, stop)`, the rows whose turns this process hands to `service`.
      exchange: `fn(value) -> [value of each process]` (`parallel.host.allgather_json`; one
        process: `lambda v: [v]`), called at every round that has turns pending.
      vocab_size: the model's, to check observation ids.

    Attributes:
      record: the `TurnRecord`; pending: `{(replica, slot): row}`, the turns handed over and
        not answered yet (their slots wait, holding their pages).
    """

    def __init__(self, batch: int, rows_per_replica: int, settings: SamplingSettings,
                 service: TurnService, owned: tuple[int, int], exchange, vocab_size: int):
        self.record, self.rows_per_replica = TurnRecord(batch), rows_per_replica
        self.settings, self.service, self.owned = settings, service, owned
        self.exchange, self.vocab_size = exchange, vocab_size
        self.pending: dict[tuple[int, int], int] = {}
        self.last: dict[int, int] = {}  # owned row -> its pending turn's last token

    def pending_mask(self, replicas: int, slots: int) -> np.ndarray:
        """`[R, S]` bool: the slots waiting for an answer (left out of decode chunks)."""
        mask = np.zeros((replicas, slots), bool)
        for r, slot in self.pending:
            mask[r, slot] = True
        return mask

    def hand_over(self, held: list[list[int]], scheds, tokens: Callable[[], np.ndarray],
                  first_replica: int) -> None:
        """Mark the newly waiting slots of `held` (per replica, from `retire`) pending, and
        submit the turns of the owned rows: `tokens()` gives this process's responses so far
        `[R_local, B / R, N]`, replicas from `first_replica` on (read only when needed)."""
        new = [(r, slot) for r in range(len(held)) for slot in held[r]
               if (r, slot) not in self.pending]
        rows, turns, local = [], [], None
        for r, slot in new:
            seq = scheds[r].slots[slot]
            b = r * self.rows_per_replica + seq.row
            self.pending[(r, slot)] = b
            if self.owned[0] <= b < self.owned[1]:
                local = tokens() if local is None else local
                turn = local[r - first_replica, seq.row, self.record.turn_start[b]:seq.length]
                rows.append(b)
                turns.append([int(t) for t in turn])
                self.last[b] = turns[-1][-1]
        if rows:
            self.service.submit(rows, turns)

    def take_answers(self, scheds) -> list[list]:
        """The answers ready on every process (this one's, checked, through `exchange`),
        applied in row order (`apply`); returns the resumes per replica."""
        waiting = set(self.pending.values())
        mine = []
        for b, answer in sorted(self.service.ready().items()):
            if b not in waiting or not self.owned[0] <= b < self.owned[1]:
                raise ValueError(f"the turn service answered row {b}, which has no turn of "
                                 "this process waiting")
            mine.append([b, self.last.pop(b), _observation(b, answer, self.vocab_size)])
        answers = sorted(tuple(a) for part in self.exchange(mine) for a in part)
        return self.apply(answers, scheds)

    def apply(self, answers, scheds) -> list[list]:
        """Apply `(row, last token, None | observation ids)` answers to the schedulers and the
        record. Returns, per replica, the resuming slots as `(slot, fed_tokens, pages)`: the
        turn's last token then the observation, and the slot's pages through them."""
        slot_of = {b: key for key, b in self.pending.items()}
        resumes = [[] for _ in scheds]
        n, record = self.settings.max_new_tokens, self.record
        for b, last, obs in answers:
            r, slot = slot_of[b]
            del self.pending[(r, slot)]
            length = scheds[r].slots[slot].length
            record.turn_ends[b].append(length - 1)
            if obs is None or len(record.turn_ends[b]) >= self.settings.turns.max_turns:
                record.ended[b] = True
                scheds[r].end(slot, length)
                continue
            room = n - length  # columns after the turn's last token
            obs = list(obs[:room])
            record.observations[b].append((length, obs))
            if len(obs) >= room:  # no column left for an action: the budget ends the row
                record.turn_start[b] = n
                scheds[r].end(slot, n)
                continue
            record.turn_start[b] = length + len(obs)
            pages = scheds[r].extend(slot, len(obs) + 1)
            resumes[r].append((slot, [last] + obs, list(pages)))
        return resumes


def episodes_of(record: TurnRecord, response_ids, response_mask, logprobs, lengths,
                first_row: int = 0):
    """The finished batch with the observations written in: `(response_ids, response_mask,
    logprobs, Episodes)`, numpy arrays (the engine lays them out).

    `response_ids`, `response_mask`, `logprobs`: `engine_programs.finalize`'s host arrays of
    this process's rows `[B_local, N]`, batch rows `first_row` on (all B with one process);
    `lengths [B]`: every row's response length (the schedulers' final lengths, known on every
    process). The action mask comes back for the same local rows; turns, turn ends and ended
    for all B rows. A row the budget cut in the middle of a turn counts that turn."""
    ids, mask, logp = (np.array(x) for x in (response_ids, response_mask, logprobs))
    actions = mask.copy()
    for i in range(ids.shape[0]):
        for column, obs in record.observations[first_row + i]:
            ids[i, column:column + len(obs)] = obs
            actions[i, column:column + len(obs)] = 0
    cut = ~record.ended & (np.asarray(lengths) > record.turn_start)
    turns = np.array([len(e) for e in record.turn_ends], np.int32) + cut
    return ids, mask, logp, Episodes(actions, turns.astype(np.int32),
                                     tuple(map(tuple, record.turn_ends)), record.ended.copy())
