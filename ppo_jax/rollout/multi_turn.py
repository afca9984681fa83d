"""Multi-turn rollouts: the model's turn ends at a stop sequence or a stop token, a host callback
(the environment) answers, its observation joins the same sequence, generation resumes.

    settings = MultiTurnSettings(max_new_tokens=512, temperature=1.0, stop_token_ids=(eos,),
                                 stop_sequences=(tuple(tok.encode("</calc>")),), max_turns=4)
    out = generate_multi_turn(model, prompt_ids, prompt_mask, key, settings=settings,
                              on_turn_end=env)   # env(rows, turn_tokens) -> [None | [ids], ...]

The response of row b is one contiguous run of N = `max_new_tokens` columns: action tokens,
then observation tokens, then action tokens ... then padding. `response_mask` stays a prefix
mask (1 through the last written token), the contract of the forward passes (token t's
log-prob read at position P - 1 + t: `rollout.forward`), and `action_mask` marks the drawn
tokens only: observations are context, not actions (their KL, losses and advantages masked
out), as verl's multi-turn rollout (`verl/workers/rollout/schemas.py`, `AsyncRolloutRequest`:
tool responses appended with `loss_mask` 0) and OpenRLHF's `MultiTurnExecutor`
(`openrlhf/utils/agent.py`: `action_ranges` over the drawn spans) do.

How: the static sampler's prefill and one-token passes (`multi_turn_programs`), in jitted
segments that return to the host whenever a row's turn ends; the host asks `on_turn_end`, writes
the observations after the turns that asked for them, and re-enters with the KV cache donated.
An observation is fed as forced tokens through the same passes, so the history is never
re-encoded; the cost is one pass per observation token and one host round trip per column at
which some turn ends (see `multi_turn_programs`). Token t of row b is drawn with the key of
`rollout.sampler.generate` (`fold_in(fold_in(rng, first_row + b), t)`), so a row whose first
turn is its last gets `generate`'s tokens and log-probs, bit for bit, up to its turn end.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ppo_jax.models.functional import Model
from ppo_jax.rollout.multi_turn_programs import TurnState, segment, start
from ppo_jax.rollout.prefill import check_groups
from ppo_jax.rollout.sampler import check_settings, int_setting, is_key, prompt_arrays, token_id

# on_turn_end(rows, turn_tokens) -> one answer per row: None (the episode ends) or observation ids
TurnCallback = Callable[[list, list], Sequence[Optional[Sequence[int]]]]


@dataclass(frozen=True)
class MultiTurnSettings:
    """Static settings of `generate_multi_turn` (hashable: a static jit argument).

    The sampling fields are `sampler.SamplingSettings`'s, with `max_new_tokens` = N the whole
    response budget (action and observation tokens). `stop_token_ids` end a turn as well as
    `stop_sequences` (token-id tuples matched on the last drawn tokens of the turn, e.g. the ids
    of `</calc>` as the model spells it: ids, not text, so list each spelling the tokenizer
    may give); `max_turns` (>= 1) ends a row after that many turns. `mesh` lays the rows out as
    in `generate`; the driver reads the whole batch on the host, so one process only.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    stop_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    samples_per_prompt: int = 1
    mesh: Optional[Mesh] = None
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    max_turns: int = 1


class MultiTurnRollout(NamedTuple):
    """The episodes of B rows over N response columns.

    response_ids `[B, N]` int32 (pad after the last token), response_mask `[B, N]` int32 (1
    through the last written token: a prefix mask), action_mask `[B, N]` int32 (1 on drawn
    tokens, 0 on observation tokens and padding), logprobs `[B, N]` float32 (each draw's
    log-prob, `sampling.draw`; 0 elsewhere): device arrays.
    turns `[B]` int32: assistant turns taken (the ended ones, plus one cut by the budget).
    turn_ends: per row, the response columns where its turns ended (where `on_turn_end` was
      called).
    ended `[B]` bool: the episode ended at a turn end (the environment answered None, or
      max_turns); False when the budget N cut it (a turn, or an observation, that did not fit).
    """

    response_ids: jax.Array
    response_mask: jax.Array
    action_mask: jax.Array
    logprobs: jax.Array
    turns: np.ndarray
    turn_ends: tuple[tuple[int, ...], ...]
    ended: np.ndarray


def check_multi_turn_settings(settings, cfg, prompt_width: int) -> MultiTurnSettings:
    """Validate `settings` for a model config and a prompt width; returns them normalised
    (ints, tuples). Raises ValueError naming the field and its value (`sampler.check_settings`
    for the sampling fields)."""
    if not isinstance(settings, MultiTurnSettings):
        raise ValueError(f"settings must be a MultiTurnSettings, got {type(settings).__name__}")
    s = settings
    base = check_settings(cfg, prompt_width, s.max_new_tokens, s.temperature, s.top_k, s.top_p,
                          s.greedy, s.stop_token_ids, s.pad_token_id, None)
    base.pop("cache_dtype")
    seqs = s.stop_sequences
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
    return replace(s, **base, stop_sequences=tuple(normal),
                   max_turns=int_setting("max_turns", s.max_turns, 1))


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


class _Episodes:
    """The host's record of every row: its turn ends and whether a turn end ended it."""

    def __init__(self, batch: int):
        self.turn_ends = [[] for _ in range(batch)]
        self.ended = np.zeros(batch, bool)


def answer_turns(state: TurnState, on_turn_end, episodes: _Episodes, settings,
                 vocab_size: int) -> TurnState:
    """Ask the environment about every waiting row and write its answer into the state.

    Each waiting row b is handed its turn's tokens (columns `turn_start[b] .. t`). None, or the
    row's `max_turns`-th turn: the row ends (whatever the answer, which is still checked). A
    list of ids: written at columns t + 1 .. as forced tokens, the next turn starting after
    them; an observation that reaches the last column (no column left for an action) is cut to
    the budget, written as it is (response mask 1, action mask 0, never fed) and the row ends.
    """
    t, n = int(state.t), settings.max_new_tokens
    tokens, rmask, done, waiting, forced_end, turn_start = (np.array(x) for x in jax.device_get(
        (state.tokens, state.response_mask, state.done, state.waiting, state.forced_end,
         state.turn_start)))
    rows = [int(b) for b in np.flatnonzero(waiting)]
    answers = ask(on_turn_end, rows, [tokens[b, turn_start[b]:t + 1].tolist() for b in rows],
                   vocab_size)
    for b, obs in zip(rows, answers):
        episodes.turn_ends[b].append(t)
        if obs is None or len(episodes.turn_ends[b]) >= settings.max_turns:
            done[b], episodes.ended[b] = True, True
            continue
        room = n - 1 - t  # columns after this one
        obs = obs[:room]
        tokens[b, t + 1:t + 1 + len(obs)] = obs
        if len(obs) >= room:  # no column left for an action: the budget ends the row
            rmask[b, t + 1:] = 1
            done[b], turn_start[b] = True, n
        else:
            forced_end[b] = turn_start[b] = t + 1 + len(obs)
    waiting[:] = False
    return state.replace(tokens=jnp.asarray(tokens), response_mask=jnp.asarray(rmask),
                         done=jnp.asarray(done), waiting=jnp.asarray(waiting),
                         forced_end=jnp.asarray(forced_end), turn_start=jnp.asarray(turn_start))


def _rollout(state: TurnState, episodes: _Episodes) -> MultiTurnRollout:
    """The record as a `MultiTurnRollout`; a row the budget cut in the middle of a turn (drawn
    tokens after its last turn start) counts that turn too."""
    actions, turn_start = (np.asarray(x) for x in jax.device_get((state.action_mask,
                                                                   state.turn_start)))
    cut = np.array([not e and actions[b, s:].any()
                    for b, (e, s) in enumerate(zip(episodes.ended, turn_start))])
    turns = np.array([len(e) for e in episodes.turn_ends], np.int32) + cut
    return MultiTurnRollout(state.tokens, state.response_mask, state.action_mask, state.logprobs,
                            turns.astype(np.int32), tuple(map(tuple, episodes.turn_ends)),
                            episodes.ended.copy())


def generate_multi_turn(model: Model, prompt_ids, prompt_mask, rng, *,
                        settings: MultiTurnSettings, on_turn_end: TurnCallback,
                        first_row: int = 0) -> MultiTurnRollout:
    """Sample multi-turn episodes for a batch of left-padded prompts.

    Args:
      model: the actor (`Model`: graphdef and params).
      prompt_ids, prompt_mask: `[B, P]` as `sampler.generate` (left-padded; with
        `samples_per_prompt` n, adjacent groups of n copies of a prompt, prefilled once).
      rng: PRNG key; may be None when greedy.
      settings: `MultiTurnSettings` (N = `max_new_tokens`, the whole response budget).
      on_turn_end: the environment, called on the host as `on_turn_end(rows, turn_tokens)`
        whenever turns end: `rows` the batch rows (0 .. B - 1, whatever `first_row`) whose turn
        ended at the current column, `turn_tokens` each one's turn as a list of token ids (from
        its first drawn token to the stop token / the last token of the stop sequence). It
        returns one answer per row: None ends the episode; a list of token ids (the observation,
        cut by the caller to its own maximum; [] is allowed) is appended to the sequence and
        the model's next turn follows it. An observation that leaves no column for an action is
        cut to the budget and ends the row. At a row's `max_turns`-th turn end the callback is
        still called (to let the environment score the turn) and the row ends whatever it says.
      first_row: the batch row of this call's first row, for the draws' keys (traced).

    Returns:
      `MultiTurnRollout`. Token t of row b is drawn with `generate`'s key, so an episode that
      ends at its first turn end (or never ends a turn) has `generate`'s tokens, mask and
      log-probs up to there, bit for bit.

    Raises:
      ValueError: as `generate` for the prompts, the sampling settings and `samples_per_prompt`;
        an empty stop sequence, ids outside the vocabulary, max_turns < 1 (all before any
        compile); an answer of `on_turn_end` that is not None or a list of ids in the
        vocabulary, or not one answer per row (naming the row).
    """
    cfg = model.merge().cfg
    prompt_ids, prompt_mask = prompt_arrays(prompt_ids, prompt_mask, cfg.vocab_size)
    settings = check_multi_turn_settings(settings, cfg, prompt_ids.shape[1])
    settings = replace(settings, samples_per_prompt=check_groups(
        prompt_ids, prompt_mask, settings.samples_per_prompt))
    if not callable(on_turn_end):
        raise ValueError(f"on_turn_end={on_turn_end!r} must be callable")
    if rng is None:
        if not settings.greedy:
            raise ValueError("rng is required for sampling (greedy=False)")
        rng = jax.random.PRNGKey(0)
    elif not is_key(rng):
        raise ValueError(f"rng must be a PRNG key (jax.random.key or jax.random.PRNGKey), got "
                         f"{type(rng).__name__} {getattr(rng, 'shape', '')}")
    first_row = jnp.int32(first_row)
    device = replace(settings, max_turns=1)  # the host counts turns: one compile for any max_turns
    state, cache = start(model, jnp.asarray(prompt_ids), jnp.asarray(prompt_mask), rng,
                         first_row, settings=device)
    episodes = _Episodes(prompt_ids.shape[0])
    while True:
        state, cache = segment(model, state, cache, rng, first_row, settings=device)
        if not np.asarray(state.waiting).any():
            return _rollout(state, episodes)
        state = answer_turns(state, on_turn_end, episodes, settings, cfg.vocab_size)
