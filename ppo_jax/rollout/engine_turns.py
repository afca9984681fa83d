"""Multi-turn episodes on the paged engine: the host side (`rollout.engine` runs it when
`generate` gets an `on_turn_end`).

A slot whose drawn token ends a turn (a stop token, or the last token of a stop sequence inside
the turn: `rollout.multi_turn`'s rule) is done for the rest of its decode chunk and keeps its
slot and its pages: it **waits at the chunk boundary**. After the chunk, the host hands every
waiting turn of every replica to `on_turn_end` in one call, then, for each answer:

- None, or the row's `max_turns`-th turn: the episode ends; its slot and pages come free
  (`scheduler.ReplicaScheduler.end`).
- an observation of m tokens that leaves a column for an action: the slot's pages grow by what
  m + 1 fed tokens need (`ReplicaScheduler.extend`), and one `resume_program` call per round
  feeds every resuming slot's last token and observation into its pages (a chunked prefill at
  the slot's own positions) and draws its next turn's first token; the slot decodes in the
  next chunk.
- an observation that reaches the budget: written as it is, cut to the budget, and the row
  ends (as `rollout.multi_turn`).

Why wait rather than give the slot up: the answer comes within the same host round (the
environment is called synchronously between chunks), so a freed slot would be refilled and
the episode re-admitted by re-encoding its whole history, where waiting costs the rest of one
chunk (at most k - 1 steps, as for a sequence that finishes mid-chunk). Waiting sequences are
never preempted: a multi-turn engine's pool holds every slot's longest sequence
(`engine.engine_layout`), since a preempted episode could not be recomputed without asking its
environment again.

The observation columns are not written on the devices: the host knows them and writes them
into the final arrays with the action mask (0 there), as `rollout.multi_turn` does.
"""

from __future__ import annotations

import numpy as np

from ppo_jax.rollout.multi_turn import MultiTurnRollout, MultiTurnSettings, ask


class TurnRecord:
    """The host's record of B rows: turn ends (response columns), whether a turn end ended the
    episode, the current turn's first column, and the observations written `(column, ids)`."""

    def __init__(self, batch: int):
        self.turn_ends = [[] for _ in range(batch)]
        self.ended = np.zeros(batch, bool)
        self.turn_start = np.zeros(batch, np.int64)
        self.observations = [[] for _ in range(batch)]


def answer_turns(held: list[list[int]], scheds, tokens: np.ndarray, record: TurnRecord,
                 settings: MultiTurnSettings, on_turn_end, vocab_size: int) -> list[list]:
    """Ask `on_turn_end` about every waiting slot (`held[r]`: replica r's slots; `tokens
    [R, B / R, N]` the responses so far) and apply its answers to the schedulers and `record`.

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
        if obs is None or len(record.turn_ends[b]) >= settings.max_turns:
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


def rollout_of(record: TurnRecord, response_ids, response_mask, logprobs) -> MultiTurnRollout:
    """The finished batch (`engine_programs.finalize`'s host arrays `[B, N]`) with the
    observations written in and the action mask, as a `MultiTurnRollout` (numpy arrays; the
    engine lays them out). A row the budget cut in the middle of a turn counts that turn."""
    ids, mask, logp = (np.array(x) for x in (response_ids, response_mask, logprobs))
    actions = mask.copy()
    for b, spans in enumerate(record.observations):
        for column, obs in spans:
            ids[b, column:column + len(obs)] = obs
            actions[b, column:column + len(obs)] = 0
    lengths = mask.sum(axis=1)
    cut = ~record.ended & (lengths > record.turn_start)
    turns = np.array([len(e) for e in record.turn_ends], np.int32) + cut
    return MultiTurnRollout(ids, mask, actions, logp, turns.astype(np.int32),
                            tuple(map(tuple, record.turn_ends)), record.ended.copy())
