"""Multi-turn episodes: the host side of the turn loop that `rollout.engine` runs when its
`SamplingSettings` have `turns`. The model's turn ends at a stop token or a stop sequence, the
environment answers in a host callback, its observation joins the same sequence and the
model's next turn follows it.

    settings = SamplingSettings(..., turns=TurnSettings(stop_sequences=(tuple(
        tok.encode("</calc>")),), max_turns=4))
    out = sampler(actor, prompt_ids, prompt_mask, key, settings, on_turn_end=env)
    # env(rows, turn_tokens) -> [None | [ids], ...];  out.episodes: `Episodes`

The response of row b is one contiguous run of N = `max_new_tokens` columns: action tokens,
then observation tokens, then action tokens ... then padding. `response_mask` stays a prefix
mask, 1 through the last written token, since the forward passes read token t's log-prob at
position P - 1 + t (`rollout.forward`). `action_mask` marks the drawn tokens only:
observations are context, not actions, so their KL, losses and advantages are masked out.
verl's multi-turn rollout does the same (`AsyncRolloutRequest` in
`verl/workers/rollout/schemas.py` appends tool responses with `loss_mask` 0), as does
OpenRLHF's `MultiTurnExecutor` (`action_ranges` over the drawn spans in
`openrlhf/utils/agent.py`).

The turn loop: a slot whose drawn token ends a turn (a stop token, or the last token of a stop
sequence inside the turn) is done for the rest of its decode chunk and keeps its slot and its
pages: it **waits at the chunk boundary**. After the chunk the host hands every waiting turn of
every replica to `on_turn_end` in one call (`answer_turns`), then, for each answer:

- None, or the row's `max_turns`-th turn: the episode ends; its slot and pages come free.
- an observation of m tokens that leaves a column for an action: the slot's pages grow by what
  m + 1 fed tokens need, and the engine feeds the turn's last token and the observation into
  its pages (a chunked prefill at the slot's own positions: the history is never re-encoded)
  and draws its next turn's first token; the slot decodes in the next chunk.
- an observation that reaches the budget: written as it is, cut to the budget, and the row
  ends (not `ended`: the budget cut it).

Why wait rather than give the slot up: the answer comes within the same host round, so a freed
slot would be refilled and the episode re-admitted by re-encoding its whole history, where
waiting costs the rest of one chunk. Waiting sequences are never preempted: a multi-turn
engine's pool holds every slot's longest sequence (`engine_layout.engine_layout`), since a
preempted episode could not be recomputed without asking its environment again. The
observation columns are not written on the devices: the host knows them and writes them into
the final arrays with the action mask (0 there): `episodes_of`.

Token t of row b is drawn with the single-turn key (`rollout.draws`), so a row whose first turn
is its last has the single-turn tokens and log-probs up to its turn end.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, NamedTuple, Optional, Sequence

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


def ask(on_turn_end, rows: list[int], turns: list[list[int]], vocab_size: int) -> list:
    """`on_turn_end(rows, turns)`, its answers checked: one per row, each None or a list of ids
    in the vocabulary (ValueError naming the row otherwise)."""
    answers = on_turn_end(rows, turns)
    if isinstance(answers, (str, bytes)) or not hasattr(answers, "__len__") or \
            len(answers) != len(rows):
        n = len(answers) if hasattr(answers, "__len__") else type(answers).__name__
        raise ValueError(f"on_turn_end must return one answer per row ({len(rows)} rows: "
                         f"{rows}), got {n}")
    return [_observation(b, a, vocab_size) for b, a in zip(rows, answers)]


class TurnRecord:
    """The host's record of B rows: turn ends (response columns), whether a turn end ended the
    episode, the current turn's first column, and the observations written `(column, ids)`."""

    def __init__(self, batch: int):
        self.turn_ends = [[] for _ in range(batch)]
        self.ended = np.zeros(batch, bool)
        self.turn_start = np.zeros(batch, np.int64)
        self.observations = [[] for _ in range(batch)]


def answer_turns(held: list[list[int]], scheds, tokens: np.ndarray, record: TurnRecord,
                 settings: SamplingSettings, on_turn_end, vocab_size: int) -> list[list]:
    """Ask `on_turn_end` about every waiting slot (`held[r]`: replica r's slots, `scheds[r]` its
    `scheduler.ReplicaScheduler`; `tokens [R, B / R, N]` the responses so far) and apply its
    answers to the schedulers and `record` (module doc).

    Returns, per replica, the resuming slots as `(slot, fed_tokens, pages)`: the turn's last
    token then the observation, and the slot's pages through them."""
    rows_per_replica, n = tokens.shape[1], settings.max_new_tokens
    waiting = [(r, slot, scheds[r].slots[slot]) for r in range(len(held)) for slot in held[r]]
    rows = [r * rows_per_replica + seq.row for r, _, seq in waiting]
    turns = [tokens[r, seq.row, record.turn_start[b]:seq.length].tolist()
             for (r, _, seq), b in zip(waiting, rows)]
    answers = ask(on_turn_end, rows, turns, vocab_size)
    resumes = [[] for _ in held]
    for (r, slot, seq), b, obs in zip(waiting, rows, answers):
        length = seq.length
        record.turn_ends[b].append(length - 1)
        if obs is None or len(record.turn_ends[b]) >= settings.turns.max_turns:
            record.ended[b] = True
            scheds[r].end(slot, length)
            continue
        room = n - length  # columns after the turn's last token
        obs = obs[:room]
        record.observations[b].append((length, obs))
        if len(obs) >= room:  # no column left for an action: the budget ends the row
            record.turn_start[b] = n
            scheds[r].end(slot, n)
            continue
        record.turn_start[b] = length + len(obs)
        last = int(tokens[r, seq.row, length - 1])
        pages = scheds[r].extend(slot, len(obs) + 1)
        resumes[r].append((slot, [last] + list(obs), list(pages)))
    return resumes


def episodes_of(record: TurnRecord, response_ids, response_mask, logprobs):
    """The finished batch (`engine_programs.finalize`'s host arrays `[B, N]`) with the
    observations written in: `(response_ids, response_mask, logprobs, Episodes)`, numpy arrays
    (the engine lays them out). A row the budget cut in the middle of a turn counts that turn."""
    ids, mask, logp = (np.array(x) for x in (response_ids, response_mask, logprobs))
    actions = mask.copy()
    for b, spans in enumerate(record.observations):
        for column, obs in spans:
            ids[b, column:column + len(obs)] = obs
            actions[b, column:column + len(obs)] = 0
    lengths = mask.sum(axis=1)
    cut = ~record.ended & (lengths > record.turn_start)
    turns = np.array([len(e) for e in record.turn_ends], np.int32) + cut
    return ids, mask, logp, Episodes(actions, turns.astype(np.int32),
                                     tuple(map(tuple, record.turn_ends)), record.ended.copy())
