"""Multi-turn rollouts (rollout.multi_turn): an episode equals its turns generated one by one,
a first turn that is the last is `generate`'s bit for bit, the budget and max_turns end rows,
bad settings and bad environment answers are refused by name, and observation tokens follow
the chat template."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from ppo_jax.models import split_model
from ppo_jax.models.functional import Model
from ppo_jax.models.heads import init_model
from ppo_jax.models.tiny_random import tiny_config
from ppo_jax.rollout import multi_turn_programs
from ppo_jax.rollout.multi_turn import MultiTurnSettings, generate_multi_turn
from ppo_jax.rollout.observations import observation_tokens
from ppo_jax.rollout.sampler import generate

VOCAB = 64
N = 16
OBS = [5, 6, 7]
TOKENIZER = Path(__file__).resolve().parents[2] / ".cache" / "smollm2-tokenizer"


@pytest.fixture(scope="module")
def model():
    """The tiny Llama with weights scaled to N(0, 0.1): peaked logits, so greedy tokens do not
    hinge on rounding (a prefill and one-token passes give the same argmax)."""
    graphdef, params = split_model(init_model(tiny_config(VOCAB), seed=3))
    return Model(graphdef, jax.tree.map(lambda p: p * 5 if p.ndim > 1 else p, params))


def prompts():
    rng = np.random.default_rng(0)
    ids = rng.integers(4, VOCAB, (2, 6)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :2] = 0
    ids[mask == 0] = 0
    return ids, mask


def greedy(model, ctx: list[int]) -> np.ndarray:
    """N greedy tokens after `ctx`, left-padded to one width (one compile for every call)."""
    width = 6 + N
    ids = np.zeros((1, width), np.int32)
    ids[0, width - len(ctx):] = ctx
    mask = (np.arange(width) >= width - len(ctx)).astype(np.int32)[None]
    out, _ = generate(model.graphdef, model.params, ids, mask, None, max_new_tokens=N,
                      greedy=True)
    return np.asarray(out)[0]


def first_turn_end(tokens, stops, seqs):
    for j in range(len(tokens)):
        if tokens[j] in stops or any(j >= len(q) - 1 and tuple(tokens[j - len(q) + 1:j + 1]) == q
                                     for q in seqs):
            return j
    return None


def reference(model, ids, mask, env, *, stops, seqs, max_turns):
    """Each row's episode built turn by turn: `generate` on the prompt, cut at the first turn
    end, the environment's observation appended, `generate` again on all of it as a new prompt."""
    out = []
    for b in range(len(ids)):
        ctx, resp, act, turns = ids[b][mask[b] == 1].tolist(), [], [], 0
        while len(resp) < N:
            drawn = greedy(model, ctx)[:N - len(resp)].tolist()
            e = first_turn_end(drawn, stops, seqs)
            if e is None:
                resp, act = resp + drawn, act + [1] * len(drawn)
                break
            resp, act, turns = resp + drawn[:e + 1], act + [1] * (e + 1), turns + 1
            answer = env(b, drawn[:e + 1])
            if answer is None or turns == max_turns:
                break
            obs = answer[:N - len(resp)]
            resp, act, ctx = resp + obs, act + [0] * len(obs), ctx + drawn[:e + 1] + obs
        out.append((resp, act))
    return out


def batched(env, calls=None):
    """A per-row environment `env(row, turn)` as `on_turn_end(rows, turns)`."""
    def on_turn_end(rows, turns):
        if calls is not None:
            calls.extend(rows)
        return [env(b, t) for b, t in zip(rows, turns)]
    return on_turn_end


class Script:
    """The scripted environment: a turn that ends on a stop token ends the episode; else turn 1
    -> OBS, turn 2 -> None. `reset()` before each episode."""

    def __init__(self, stops):
        self.stops, self.turns = stops, {}

    def reset(self):
        self.turns = {}

    def __call__(self, row, turn):
        self.turns[row] = self.turns.get(row, 0) + 1
        if turn[-1] in self.stops:
            return None
        return list(OBS) if self.turns[row] == 1 else None


@pytest.fixture(scope="module")
def script(model):
    """Stops read from the model's greedy tokens: a pair of row 0's tokens (columns 3-4) ends
    its turn 1, a token of its turn 2 (after OBS) ends that, a token of row 1 (from column 2 on,
    none of row 0's) ends row 1's turn 1."""
    ids, mask = prompts()
    free = [greedy(model, ids[b][mask[b] == 1].tolist()) for b in range(2)]
    seq = tuple(int(x) for x in free[0][3:5])
    second = greedy(model, ids[0].tolist() + free[0][:5].tolist() + OBS)
    taken = {*free[0][:5].tolist(), *second[:3].tolist()}  # row 0's turns must not stop on it
    end1 = next(j for j in range(2, N) if int(free[1][j]) not in taken)
    stops = (int(second[2]), int(free[1][end1]))
    return dict(seq=seq, stops=stops, env=Script(stops), end1=end1)


def settings(script, **kw):
    return MultiTurnSettings(**{"max_new_tokens": N, "greedy": True, "stop_token_ids":
                                script["stops"], "stop_sequences": (script["seq"],),
                                "max_turns": 4, **kw})


def test_scripted_episode_equals_its_turns_generated_one_by_one(model, script):
    ids, mask = prompts()
    script["env"].reset()
    want = reference(model, ids, mask, script["env"], stops=script["stops"],
                     seqs=(script["seq"],), max_turns=4)
    script["env"].reset()
    out = generate_multi_turn(model, ids, mask, None, settings=settings(script),
                              on_turn_end=batched(script["env"]))
    ids_, rmask, amask, lp = (np.asarray(x) for x in out[:4])
    for b, (resp, act) in enumerate(want):
        n = len(resp)
        np.testing.assert_array_equal(ids_[b, :n], resp, err_msg=f"row {b}")
        np.testing.assert_array_equal(amask[b, :n], act, err_msg=f"row {b}")
        np.testing.assert_array_equal(rmask[b], np.arange(N) < n, err_msg=f"row {b}")
        assert (ids_[b, n:] == 0).all() and (amask[b, n:] == 0).all()
        assert (lp[b][amask[b] == 0] == 0).all() and (lp[b][amask[b] == 1] < 0).all()
    # row 0 took two turns around the observation; row 1 ended at a stop token on turn 1
    assert out.turn_ends == ((4, 4 + len(OBS) + 3), (script["end1"],))
    np.testing.assert_array_equal(out.turns, [2, 1])
    np.testing.assert_array_equal(out.ended, [True, True])
    np.testing.assert_array_equal(ids_[0, 5:8], OBS)
    np.testing.assert_array_equal(amask[0, :11], [1] * 5 + [0] * 3 + [1] * 3)


def test_a_single_turn_is_generates_sampling_bit_for_bit(model):
    """Sampling (temperature, top-p), groups of 2 samples, first_row 3: a row whose first turn
    ends the episode has `generate`'s tokens and log-probs up to its turn end; a row that ends
    on the stop token or runs to the budget is `generate`'s whole row."""
    ids, mask = prompts()
    ids, mask = np.repeat(ids, 2, axis=0), np.repeat(mask, 2, axis=0)
    kw = dict(temperature=0.8, top_p=0.9, samples_per_prompt=2, pad_token_id=0)
    key = jax.random.PRNGKey(7)
    free = np.asarray(generate(model.graphdef, model.params, ids, mask, key, max_new_tokens=N,
                               first_row=3, **kw)[0])
    stop, seq = int(free[2, 6]), tuple(int(x) for x in free[0, 2:4])
    want = [np.asarray(x) for x in generate(model.graphdef, model.params, ids, mask, key,
                                            max_new_tokens=N, first_row=3, stop_token_ids=(stop,),
                                            return_logprobs=True, **kw)]
    calls = []
    out = generate_multi_turn(model, ids, mask, key, first_row=3, on_turn_end=batched(
        lambda b, t: None, calls), settings=MultiTurnSettings(
            max_new_tokens=N, stop_token_ids=(stop,), stop_sequences=(seq,), max_turns=3, **kw))
    got = [np.asarray(x) for x in (out.response_ids, out.response_mask, out.logprobs)]
    ends = [e[0] + 1 if e else N for e in out.turn_ends]
    for b, end in enumerate(ends):
        for g, w in zip(got[:2], want[:2]):  # tokens and mask: bit for bit
            np.testing.assert_array_equal(g[b, :end], w[b, :end], err_msg=f"row {b}")
            assert not g[b, end:].any()
        # log-probs: bit for bit under XLA's default backend optimisation; the test session
        # compiles at level 0 (tests/conftest.py), where the two programs' log-softmax may
        # round the last bit apart (one float32 ulp seen)
        np.testing.assert_allclose(got[2][b, :end], want[2][b, :end], rtol=1e-6, atol=0,
                                   err_msg=f"row {b}")
        assert not got[2][b, end:].any()
        np.testing.assert_array_equal(out.action_mask[b], got[1][b])  # no observations
    by_seq = [b for b in range(4) if out.turn_ends[b] and got[0][b, ends[b] - 1] != stop]
    by_stop = [b for b in range(4) if out.turn_ends[b] and got[0][b, ends[b] - 1] == stop]
    assert by_seq and by_stop, (out.turn_ends, ends)  # both kinds of turn end were exercised
    for b in by_stop:  # the whole row, mask and log-probs: generate's
        np.testing.assert_array_equal(got[1][b], want[1][b])
    assert sorted(calls) == [b for b in range(4) if out.turn_ends[b]]
    np.testing.assert_array_equal(out.turns, 1)
    np.testing.assert_array_equal(out.ended, [bool(e) for e in out.turn_ends])


def test_an_observation_past_the_budget_is_cut_and_ends_the_row(model, script):
    ids, mask = prompts()
    calls = []
    long = list(range(8, 8 + 40))
    out = generate_multi_turn(model, ids, mask, None, settings=settings(script),
                              on_turn_end=batched(lambda b, t: long if b == 0 else None, calls))
    ids_, rmask, amask = (np.asarray(x) for x in out[:3])
    np.testing.assert_array_equal(ids_[0, 5:], long[:N - 5])  # 11 columns were left
    np.testing.assert_array_equal(rmask[0], 1)
    np.testing.assert_array_equal(amask[0], [1] * 5 + [0] * (N - 5))
    assert calls == [1, 0]  # row 1's turn ended first (column 2 or 3), row 0's at 4; no more
    assert out.turn_ends == ((4,), (script["end1"],)) and out.turns.tolist() == [1, 1]
    np.testing.assert_array_equal(out.ended, [False, True])  # the budget cut row 0


def test_max_turns_ends_the_row_whatever_the_environment_says(model, script):
    ids, mask = prompts()
    calls = []
    out = generate_multi_turn(model, ids, mask, None, settings=settings(script, max_turns=2),
                              on_turn_end=batched(lambda b, t: list(OBS), calls))
    assert out.turn_ends[0] == (4, 10) and calls.count(0) == 2  # called for the last turn too
    assert out.turns[0] == 2 and out.ended[0]
    np.testing.assert_array_equal(np.asarray(out.response_mask)[0], np.arange(N) < 11)
    assert len(out.turn_ends[1]) <= 2 and calls.count(1) == len(out.turn_ends[1])


def test_a_row_cut_by_the_budget_in_a_turn_counts_it_and_is_not_ended(model):
    ids, mask = prompts()
    out = generate_multi_turn(model, ids, mask, None, on_turn_end=batched(lambda b, t: None),
                              settings=MultiTurnSettings(max_new_tokens=N, greedy=True))
    np.testing.assert_array_equal(np.asarray(out.action_mask), 1)
    assert out.turns.tolist() == [1, 1] and not out.ended.any() and out.turn_ends == ((), ())


@pytest.mark.parametrize("kw,match", [
    (dict(stop_sequences=((),)), r"stop_sequences\[0\] is empty"),
    (dict(stop_sequences=((3, VOCAB),)), rf"stop_sequences\[0\]: {VOCAB} is outside the vocab"),
    (dict(stop_sequences=((3,), (-2,))), r"stop_sequences\[1\]: -2 is outside"),
    (dict(stop_sequences=("</calc>",)), r"stop_sequences\[0\]='</calc>' must be a sequence of "
                                        "token ids"),
    (dict(stop_sequences=7), "stop_sequences=7 must be a sequence"),
    (dict(max_turns=0), "max_turns=0 must be >= 1"),
    (dict(max_turns=1.5), "max_turns=1.5 must be an int"),
    (dict(stop_token_ids=(VOCAB,)), "stop_token_ids: 64 is outside"),
    (dict(max_new_tokens=0), "max_new_tokens=0 must be >= 1"),
    (dict(greedy=False, temperature=0.0), "temperature=0.0"),
    (dict(samples_per_prompt=3), "samples_per_prompt=3 does not divide"),
])
def test_bad_settings_name_the_field_before_compiling(model, kw, match):
    ids, mask = prompts()
    compiled = (multi_turn_programs.start._cache_size(), multi_turn_programs.segment._cache_size())
    base = dict(max_new_tokens=N, greedy=True, stop_sequences=((3, 4),), max_turns=2)
    with pytest.raises(ValueError, match=match):
        generate_multi_turn(model, ids, mask, jax.random.PRNGKey(0), on_turn_end=lambda r, t: [],
                            settings=MultiTurnSettings(**{**base, **kw}))
    assert (multi_turn_programs.start._cache_size(),
            multi_turn_programs.segment._cache_size()) == compiled


@pytest.mark.parametrize("answer,match", [
    (lambda rows, turns: ["5 6"] * len(rows), "answer for row 1 must be None .* got str"),
    (lambda rows, turns: [[3, VOCAB]] * len(rows), f"answer for row 1: {VOCAB} is outside"),
    (lambda rows, turns: [[3, 2.0]] * len(rows), r"answer for row 1: 2.0 is not an int"),
    (lambda rows, turns: [], r"one answer per row \(1 rows: \[1\]\), got 0"),
])
def test_bad_environment_answers_name_the_row(model, script, answer, match):
    ids, mask = prompts()
    with pytest.raises(ValueError, match=match):
        generate_multi_turn(model, ids, mask, None, settings=settings(script), on_turn_end=answer)


@pytest.fixture(scope="module")
def smollm2():
    transformers = pytest.importorskip("transformers")
    if not TOKENIZER.is_dir():
        pytest.skip(f"no tokenizer at {TOKENIZER}")
    return transformers.AutoTokenizer.from_pretrained(TOKENIZER, local_files_only=True)


@pytest.mark.parametrize("role", ["user", "tool"])
def test_observation_tokens_are_the_chat_template_between_two_assistant_turns(smollm2, role):
    said, text = "2 + 3 = <calc>2+3</calc>", "5"
    chat = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": said}]
    full = smollm2.apply_chat_template(chat + [{"role": role, "content": text}], tokenize=False,
                                       add_generation_prompt=True)
    between = full[full.index(said) + len(said):]
    assert between == f"<|im_end|>\n<|im_start|>{role}\n5<|im_end|>\n<|im_start|>assistant\n"
    ids = observation_tokens(smollm2, text, role=role, max_tokens=64)
    assert smollm2.decode(ids) == between
    assert ids == smollm2.encode(between, add_special_tokens=False)


def test_observation_tokens_cut_the_text_not_the_frame(smollm2):
    full = observation_tokens(smollm2, "one two three four five six", max_tokens=64)
    cut = observation_tokens(smollm2, "one two three four five six", max_tokens=len(full) - 3)
    assert len(cut) == len(full) - 3
    assert cut[:5] == full[:5] and cut[-5:] == full[-5:]  # the frame whole, the text cut
    with pytest.raises(ValueError, match="max_tokens=3 is below the"):
        observation_tokens(smollm2, "x", max_tokens=3)


def test_observation_tokens_without_a_template_are_the_text_on_its_own_line(smollm2):
    plain = smollm2.__class__.from_pretrained(TOKENIZER, local_files_only=True)
    plain.chat_template = None
    assert plain.decode(observation_tokens(plain, "result: 5", max_tokens=32)) == "\nresult: 5\n"


def test_observations_are_fed_one_token_a_pass_never_reencoded(model, script, monkeypatch):
    """The prefill, then one one-token pass per column up to the last turn end: the 3
    observation tokens cost 3 passes, and the history is never run again."""
    from ppo_jax.models.llama import LlamaBackbone

    widths = []
    original = LlamaBackbone.__call__

    def counted(self, input_ids, *a, **kw):
        width = input_ids.shape[1]
        jax.debug.callback(lambda: widths.append(width))
        return original(self, input_ids, *a, **kw)

    monkeypatch.setattr(LlamaBackbone, "__call__", counted)
    ids, mask = prompts()
    script["env"].reset()
    out = generate_multi_turn(model, ids, mask, None, on_turn_end=batched(script["env"]),
                              settings=settings(script, max_new_tokens=N - 4))  # a new trace
    jax.effects_barrier()
    assert out.turn_ends == ((4, 10), (script["end1"],)) and out.ended.all()
    assert widths == [ids.shape[1]] + [1] * 10  # columns 1..10 each from one pass
