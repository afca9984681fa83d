"""Multi-turn episodes (rollout.turns, the engine's turn loop through `rollout.sampler.Sampler`),
in both cache layouts (`generation.engine: static`, one page per row, and paged: small pages,
fewer slots than rows, short chunks): an episode equals its turns generated one by one, a
first turn that is the last is `generate`'s, the budget and max_turns end rows, bad settings
and bad environment answers are refused by name, observations are prefilled (the history never
re-encoded), and observation tokens follow the chat template."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from ppo_jax.models import split_model
from ppo_jax.models.functional import Model
from ppo_jax.models.heads import init_model
from ppo_jax.models.tiny_random import tiny_config
from ppo_jax.rollout.engine_layout import EngineSettings
from ppo_jax.rollout.observations import observation_tokens
from ppo_jax.rollout.sampler import Sampler
from ppo_jax.rollout.static_batch import generate
from tests.rollout.sampling_settings import sampling_settings

VOCAB = 64
N = 16
OBS = [5, 6, 7]
TOKENIZER = Path(__file__).resolve().parents[2] / ".cache" / "smollm2-tokenizer"
# generation.engine: static (None: one page per row) and paged (pages of 4, one slot per row
# of a group of 2 prompts, chunks of 3 tokens)
LAYOUTS = {"static": None,
           "paged": EngineSettings(page_size=4, num_pages=0, max_concurrent=2, decode_chunk=3,
                                   decode_buckets=2, attention="reference")}


@pytest.fixture(params=list(LAYOUTS))
def layout(request):
    return LAYOUTS[request.param]


def play(model, ids, mask, key, settings, on_turn_end, layout):
    """The episodes of `[B, P]` prompts through a `Sampler` of `layout`."""
    sampler = Sampler(layout, tiny_config(VOCAB))
    return sampler(model, ids, mask, key, settings, on_turn_end)


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


def settings(script, max_turns=4, **kw):
    return sampling_settings(**{"max_new_tokens": N, "greedy": True, "stop_token_ids":
                                script["stops"], "turns": ((script["seq"],), max_turns), **kw})


def test_scripted_episode_equals_its_turns_generated_one_by_one(model, script, layout):
    ids, mask = prompts()
    script["env"].reset()
    want = reference(model, ids, mask, script["env"], stops=script["stops"],
                     seqs=(script["seq"],), max_turns=4)
    script["env"].reset()
    out = play(model, ids, mask, None, settings(script), batched(script["env"]), layout)
    ids_, rmask, lp = (np.asarray(x) for x in out[:3])
    ep = out.episodes
    amask = np.asarray(ep.action_mask)
    for b, (resp, act) in enumerate(want):
        n = len(resp)
        np.testing.assert_array_equal(ids_[b, :n], resp, err_msg=f"row {b}")
        np.testing.assert_array_equal(amask[b, :n], act, err_msg=f"row {b}")
        np.testing.assert_array_equal(rmask[b], np.arange(N) < n, err_msg=f"row {b}")
        assert (ids_[b, n:] == 0).all() and (amask[b, n:] == 0).all()
        assert (lp[b][amask[b] == 0] == 0).all() and (lp[b][amask[b] == 1] < 0).all()
    # row 0 took two turns around the observation; row 1 ended at a stop token on turn 1
    assert ep.turn_ends == ((4, 4 + len(OBS) + 3), (script["end1"],))
    np.testing.assert_array_equal(ep.turns, [2, 1])
    np.testing.assert_array_equal(ep.ended, [True, True])
    np.testing.assert_array_equal(ids_[0, 5:8], OBS)
    np.testing.assert_array_equal(amask[0, :11], [1] * 5 + [0] * 3 + [1] * 3)


def test_a_single_turn_is_generates_sampling(model, layout):
    """Sampling (temperature, top-p), groups of 2 samples: a row whose first turn ends the
    episode has `generate`'s tokens bit for bit and its log-probs (to float rounding) up to its
    turn end; a row that ends on the stop token or runs to the budget is `generate`'s whole
    row."""
    ids, mask = prompts()
    ids, mask = np.repeat(ids, 2, axis=0), np.repeat(mask, 2, axis=0)
    kw = dict(temperature=0.8, top_p=0.9, samples_per_prompt=2, pad_token_id=0)
    key = jax.random.PRNGKey(7)
    free = np.asarray(generate(model.graphdef, model.params, ids, mask, key, max_new_tokens=N,
                               **kw)[0])
    stop, seq = int(free[2, 6]), tuple(int(x) for x in free[0, 2:4])
    want = [np.asarray(x) for x in generate(model.graphdef, model.params, ids, mask, key,
                                            max_new_tokens=N, stop_token_ids=(stop,),
                                            return_logprobs=True, **kw)]
    calls = []
    out = play(model, ids, mask, key, sampling_settings(
        max_new_tokens=N, stop_token_ids=(stop,), turns=((seq,), 3), **kw),
        batched(lambda b, t: None, calls), layout)
    got = [np.asarray(x) for x in (out.response_ids, out.response_mask, out.logprobs)]
    ep = out.episodes
    ends = [e[0] + 1 if e else N for e in ep.turn_ends]
    for b, end in enumerate(ends):
        for g, w in zip(got[:2], want[:2]):  # tokens and mask: bit for bit
            np.testing.assert_array_equal(g[b, :end], w[b, :end], err_msg=f"row {b}")
            assert not g[b, end:].any()
        # log-probs: the engine's attention over pages rounds apart from the static batch's
        # one cache (the paged engine's tests hold them to 1e-5 too)
        np.testing.assert_allclose(got[2][b, :end], want[2][b, :end], atol=1e-5,
                                   err_msg=f"row {b}")
        assert not got[2][b, end:].any()
        np.testing.assert_array_equal(np.asarray(ep.action_mask)[b], got[1][b])  # no observations
    by_seq = [b for b in range(4) if ep.turn_ends[b] and got[0][b, ends[b] - 1] != stop]
    by_stop = [b for b in range(4) if ep.turn_ends[b] and got[0][b, ends[b] - 1] == stop]
    assert by_seq and by_stop, (ep.turn_ends, ends)  # both kinds of turn end were exercised
    for b in by_stop:  # the whole row, mask and log-probs: generate's
        np.testing.assert_array_equal(got[1][b], want[1][b])
    assert sorted(calls) == [b for b in range(4) if ep.turn_ends[b]]
    np.testing.assert_array_equal(ep.turns, 1)
    np.testing.assert_array_equal(ep.ended, [bool(e) for e in ep.turn_ends])


def test_an_observation_past_the_budget_is_cut_and_ends_the_row(model, script, layout):
    ids, mask = prompts()
    calls = []
    long = list(range(8, 8 + 40))
    out = play(model, ids, mask, None, settings(script),
               batched(lambda b, t: long if b == 0 else None, calls), layout)
    ids_, rmask = (np.asarray(x) for x in out[:2])
    ep = out.episodes
    amask = np.asarray(ep.action_mask)
    np.testing.assert_array_equal(ids_[0, 5:], long[:N - 5])  # 11 columns were left
    np.testing.assert_array_equal(rmask[0], 1)
    np.testing.assert_array_equal(amask[0], [1] * 5 + [0] * (N - 5))
    assert sorted(calls) == [0, 1]  # one turn each (at a chunk boundary: maybe in one call)
    assert ep.turn_ends == ((4,), (script["end1"],)) and ep.turns.tolist() == [1, 1]
    np.testing.assert_array_equal(ep.ended, [False, True])  # the budget cut row 0


def test_max_turns_ends_the_row_whatever_the_environment_says(model, script, layout):
    ids, mask = prompts()
    calls = []
    out = play(model, ids, mask, None, settings(script, max_turns=2),
               batched(lambda b, t: list(OBS), calls), layout)
    ep = out.episodes
    assert ep.turn_ends[0] == (4, 10) and calls.count(0) == 2  # called for the last turn too
    assert ep.turns[0] == 2 and ep.ended[0]
    np.testing.assert_array_equal(np.asarray(out.response_mask)[0], np.arange(N) < 11)
    assert len(ep.turn_ends[1]) <= 2 and calls.count(1) == len(ep.turn_ends[1])


def test_a_row_cut_by_the_budget_in_a_turn_counts_it_and_is_not_ended(model, layout):
    ids, mask = prompts()
    out = play(model, ids, mask, None, sampling_settings(N, greedy=True, turns=((), 1)),
               batched(lambda b, t: None), layout)
    ep = out.episodes
    np.testing.assert_array_equal(np.asarray(ep.action_mask), 1)
    assert ep.turns.tolist() == [1, 1] and not ep.ended.any() and ep.turn_ends == ((), ())


@pytest.mark.parametrize("kw,match", [
    (dict(turns=(((),), 2)), r"stop_sequences\[0\] is empty"),
    (dict(turns=(((3, VOCAB),), 2)), rf"stop_sequences\[0\]: {VOCAB} is outside the vocab"),
    (dict(turns=(((3,), (-2,)), 2)), r"stop_sequences\[1\]: -2 is outside"),
    (dict(turns=(("</calc>",), 2)), r"stop_sequences\[0\]='</calc>' must be a sequence of "
                                    "token ids"),
    (dict(turns=(7, 2)), "stop_sequences=7 must be a sequence"),
    (dict(turns=(((3, 4),), 0)), "max_turns=0 must be >= 1"),
    (dict(turns=(((3, 4),), 1.5)), "max_turns=1.5 must be an int"),
    (dict(stop_token_ids=(VOCAB,)), "stop_token_ids: 64 is outside"),
    (dict(max_new_tokens=0), "max_new_tokens=0 must be >= 1"),
    (dict(greedy=False, temperature=0.0), "temperature=0.0"),
    (dict(samples_per_prompt=3), "not whole groups of samples_per_prompt=3"),
])
def test_bad_settings_name_the_field_before_compiling(model, kw, match):
    ids, mask = prompts()
    base = dict(max_new_tokens=N, greedy=True, turns=(((3, 4),), 2))
    sampler = Sampler(None, tiny_config(VOCAB))
    with pytest.raises(ValueError, match=match):
        sampler(model, ids, mask, jax.random.PRNGKey(0), sampling_settings(**{**base, **kw}),
                lambda r, t: [])
    assert not sampler.engines  # refused before an engine (and its programs) was built


@pytest.mark.parametrize("answer,match", [
    # both rows' first turns end inside the first chunk: one call, row 0's answer read first
    (lambda rows, turns: ["5 6"] * len(rows), "answer for row 0 must be None .* got str"),
    (lambda rows, turns: [[3, VOCAB]] * len(rows), f"answer for row 0: {VOCAB} is outside"),
    (lambda rows, turns: [[3, 2.0]] * len(rows), r"answer for row 0: 2.0 is not an int"),
    (lambda rows, turns: [], r"one answer per row \(2 rows: \[0, 1\]\), got 0"),
])
def test_bad_environment_answers_name_the_row(model, script, answer, match):
    ids, mask = prompts()
    with pytest.raises(ValueError, match=match):
        play(model, ids, mask, None, settings(script), answer, None)


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


def test_observations_are_prefilled_the_history_never_reencoded(model, script, monkeypatch):
    """Static layout: one prefill of the prompts (width P), one-token passes, and one resume
    call that feeds the turn's last token and the 3 observation tokens at once (width 4): no
    call runs the history again."""
    from ppo_jax.models.llama import LlamaBackbone

    widths = []
    original = LlamaBackbone.run  # `__call__` runs it too

    def counted(self, input_ids, *a, **kw):
        width = input_ids.shape[1]
        jax.debug.callback(lambda: widths.append(width))
        return original(self, input_ids, *a, **kw)

    monkeypatch.setattr(LlamaBackbone, "run", counted)
    ids, mask = prompts()
    script["env"].reset()
    out = play(model, ids, mask, None, settings(script, max_new_tokens=N - 4),  # a new trace
               batched(script["env"]), None)
    jax.effects_barrier()
    ep = out.episodes
    assert ep.turn_ends == ((4, 10), (script["end1"],)) and ep.ended.all()
    assert widths[0] == ids.shape[1] and widths.count(ids.shape[1]) == 1
    assert widths.count(len(OBS) + 1) == 1 and set(widths) == {ids.shape[1], 1, len(OBS) + 1}
