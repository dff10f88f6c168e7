"""Constrained decoding under speculation (constraints/): greedy output equals constrained plain
decoding token for token for every drafter, chains and trees (forbidden drafts cut, forced
tokens drafted); sampled output follows the constrained law; every output is valid against its
schema (jsonschema); the tree walk gives each node its own grammar state; hostile schemas and
grammars are refused in one line."""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import replace

import jsonschema
import pytest

from helpers import TemperedSelfDraft
from verispec.constraints import GrammarError, constraint_for
from verispec.constraints import speculation
from verispec.cost_model import CostModel
from verispec.constraints.speculation import JumpForward, forced_branches, jump_forward, node_masks, prune
from verispec.drafters.base import DraftContext, NoDrafter
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.hybrid import HybridDrafter
from verispec.drafters.suffix_tree import SuffixDecodingDrafter
from verispec.engine import Engine
from verispec.models.load import load_model
from verispec.registry import make_drafter
from verispec.tree import DraftTree
from verispec.sampling import make_generator
from verispec.types import SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "friends"],
          "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"},
                         "friends": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}}}
DRAFTERS = [("none", {}), ("prompt-lookup", {}), ("prompt-lookup", {"num_candidates": "4", "max_ngram": "2"}),
            ("suffix", {}), ("draft", {"model": "truncated:2"}),
            ("hybrid", {"learned": "draft", "learned_model": "truncated:2", "budget": "fixed"})]


@pytest.fixture(scope="module")
def stories():
    return load_model("stories260k")


@pytest.fixture(scope="module")
def schema(stories):
    return constraint_for(stories, "json_schema", SCHEMA)


def prompt_of(model, text: str) -> list[int]:
    return model.tokenizer(text)["input_ids"]


def generate(model, drafter, prompt, params, draft_limit=None, k=6):
    engine = Engine(model.backend, drafter, k)
    req = engine.add_request(prompt, params, draft_limit=draft_limit)
    while not req.finished:
        engine.step(req)
    return req.generated, req


@pytest.mark.parametrize("name,opts", DRAFTERS, ids=["forced-only", "pld", "pld-tree", "suffix", "draft", "hybrid"])
def test_greedy_equals_constrained_plain(stories, schema, name, opts):
    params = SamplingParams(max_new_tokens=120, constraint=schema)
    for text in ("Lily said: {\"name\": \"Lily\", \"age\": 3}",):
        prompt = prompt_of(stories, text)
        plain, plain_req = generate(stories, NoDrafter(), prompt, params, draft_limit=0)
        spec, req = generate(stories, make_drafter(name, stories, dict(opts)), prompt, params)
        assert spec == plain
        assert req.finished == plain_req.finished == "eos"
        jsonschema.validate(json.loads(stories.tokenizer.decode(spec)), SCHEMA)
        assert req.stats.target_forwards < plain_req.stats.target_forwards  # forced keys at least


def test_outputs_valid_for_every_kind(stories):
    prompt = prompt_of(stories, "Once upon a time")
    cases = [("regex", r"(cat|dog) [0-9]{2}", lambda s: s.split()[0] in ("cat", "dog") and len(s.split()[1]) == 2),
             ("choice", ["yes", "no", "maybe"], lambda s: s in ("yes", "no", "maybe")),
             ("grammar", 'root ::= "a" [0-9] [0-9]? "z"', lambda s: s[0] == "a" and s[-1] == "z" and s[1:-1].isdigit()),
             ("grammar", "start: WORD \"!\"\nWORD: /[a-z]{1,8}/", lambda s: s.endswith("!") and s[:-1].isalpha())]
    for kind, spec, valid in cases:
        params = SamplingParams(max_new_tokens=40, constraint=constraint_for(stories, kind, spec))
        out, req = generate(stories, make_drafter("prompt-lookup", stories, {}), prompt, params)
        text = stories.tokenizer.decode(out)
        assert req.finished == "eos" and valid(text), (kind, text)


@pytest.mark.extended  # statistics over many draws: run by .ci/run (make test-extended)
def test_sampling_follows_the_constrained_law(stories):
    """The answer's law (a short choice, many tokens decided in speculative steps) with a draft
    that carries its own q (kept, rejected by the law), point-mass drafts (cut when forbidden) and
    forced-only drafts (a choice's branches) vs constrained plain sampling: two-sample chi-square
    on the answers."""
    choice = constraint_for(stories, "regex", r"(the|a) (big|red) (cat|dog|ball)")
    prompt = prompt_of(stories, "Once upon a time there was a red ball and a big dog and a little cat")

    def answers(drafter, seeds, draft_limit=None):
        out = Counter()
        for s in seeds:
            params = SamplingParams(temperature=1.0, seed=s, max_new_tokens=12, constraint=choice)
            ids, _ = generate(stories, drafter, prompt, params, draft_limit, k=4)
            out[stories.tokenizer.decode(ids)] += 1
        return out

    from scipy.stats import chi2_contingency

    plain = answers(NoDrafter(), range(120), draft_limit=0)
    # forced-only: a choice's branches (each with its forced run) are point-mass trees
    for drafter in (TemperedSelfDraft(stories.backend), make_drafter("prompt-lookup", stories, {}), NoDrafter()):
        spec = answers(drafter, range(1000, 1120))
        keys = [a for a in set(plain) | set(spec) if plain[a] + spec[a] >= 8]
        table = [[h[a] for a in keys] + [sum(h.values()) - sum(h[a] for a in keys)] for h in (plain, spec)]
        assert chi2_contingency(table).pvalue > 1e-3
        assert all(a.split()[0] in ("the", "a") for a in spec)


def test_each_tree_node_has_its_own_grammar_state(stories):
    c = constraint_for(stories, "choice", ["cat", "car", "dog"])
    tok = stories.tokenizer
    m = c.matcher()
    first = [t for t in m.allowed().nonzero().flatten().tolist()]
    c_tok = next(t for t in first if tok.decode([t]) == "c")
    d_tok = next(t for t in first if tok.decode([t]) == "d")
    after_c = c.matcher()
    after_c.advance([c_tok])
    a_tok = next(t for t in after_c.allowed().nonzero().flatten().tolist() if tok.decode([t]) == "a")
    bad = next(t for t in range(stories.backend.info.vocab_size) if t not in first)
    # root -> c -> a, root -> d, root -> <forbidden> -> c
    tree = DraftTree((7, c_tok, d_tok, a_tok, bad, c_tok), (-1, 0, 0, 1, 0, 4))
    masks = node_masks(tree, m)
    for node in (0, 1, 2, 3):
        fresh = c.matcher()
        fresh.advance([tree.tokens[i] for i in tree.path_to(node)])
        assert masks[node].equal(fresh.allowed())
    assert m.allowed().equal(masks[0])  # the walk leaves the request's state as it was
    pruned = prune(tree, m)
    assert pruned.tokens == (7, c_tok, d_tok, a_tok) and pruned.parents == (-1, 0, 0, 1)


def test_forced_tokens_are_drafted(stories, schema):
    m = schema.matcher()
    tree = jump_forward(DraftTree.chain(5, []), m, budget=8)
    assert stories.tokenizer.decode(list(tree.tokens[1:])).startswith('{"')
    assert jump_forward(DraftTree.chain(5, []), m, budget=0).size == 1


@pytest.mark.parametrize("kind,spec,message", [
    ("json_schema", {"type": "strin"}, "strin"),
    ("json_schema", "{not json", "not valid JSON"),
    ("regex", "((", "unclosed group"),
    ("grammar", "root ::= foo", "foo"),
    ("choice", [], "list of 1 to"),
    ("json_schema", {"type": "string", "pattern": "x" * 300_000}, "at most"),
])
def test_bad_constraints_are_refused_in_one_line(stories, kind, spec, message):
    with pytest.raises(GrammarError) as e:
        constraint_for(stories, kind, spec)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_hostile_regex_is_bounded(stories):
    """A pattern whose automaton explodes is refused or compiled within the parser's fuel (CPU time:
    a busy machine does not stretch it)."""
    t0 = time.process_time()
    try:
        constraint_for(stories, "regex", "(a|b)*a(a|b){40}")
    except GrammarError:
        pass
    assert time.process_time() - t0 < 10


def test_a_constraint_for_another_vocabulary_is_refused(stories, toy_target):
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(toy_target, NoDrafter()).add_request([1, 2], SamplingParams(constraint=constraint_for(
            stories, "json_object", None)))


def test_a_grammar_spelling_an_added_token_commits_only_what_it_accepts(stories):
    """The text of an added token (``<s>``) in a regex: the mask never offers a token the grammar
    would then refuse; where that leaves the start state nothing, the grammar is refused at compile
    time, else generation ends cleanly whatever the engine makes of it."""
    try:
        c = constraint_for(stories, "regex", "<s>[a-z]{2}")
    except GrammarError as e:
        assert "allows no answer" in str(e)
        return
    out, req = generate(stories, make_drafter("prompt-lookup", stories, {}), prompt_of(stories, "Once"),
                        SamplingParams(max_new_tokens=10, constraint=c))
    assert req.finished in ("eos", "length") and not req.grammar.failed


def completion(c) -> list[int]:
    """The tokens of a constraint's first allowed completion, each the lowest id the grammar allows."""
    m, ids = c.matcher(), []
    while not m.stopped:
        ids.append(int(m.allowed().nonzero()[0]))
        m.advance(ids[-1:])
    return ids


def test_a_draft_past_the_grammars_end(stories):
    """EOS drafted where the grammar is complete ends the path (llguidance would refuse to consume
    it); nodes past it are never reachable, and the request's state is untouched."""
    c = constraint_for(stories, "choice", ["yes"])
    ids = completion(c)
    m = c.matcher()
    eos = stories.backend.info.eos_token_ids[0]
    tree = DraftTree.chain(5, [*ids, eos, 7])
    masks = node_masks(tree, m)
    assert masks[len(ids) + 1].nonzero().flatten().tolist() == [eos] and bool(masks[-1].all())
    assert prune(tree, m).tokens == (5, *ids, eos)
    assert m.allowed().equal(c.matcher().allowed())


def test_a_drafted_end_leaves_the_grammar_state_alone(stories):
    """A chain ending in EOS gets no forced tokens, and the walk's rollbacks match its advances:
    the request's state after shaping a draft is the state before."""
    c = constraint_for(stories, "choice", ["yes"])
    ids = completion(c)
    m = c.matcher()
    m.advance(ids[:1])
    eos = stories.backend.info.eos_token_ids[0]
    before = m.allowed()
    tree = jump_forward(prune(DraftTree.chain(5, [*ids[1:], eos]), m), m, budget=4)
    assert tree.tokens == (5, *ids[1:], eos)
    node_masks(tree, m)
    assert m.allowed().equal(before) and m.advance(ids[1:]) and m.stopped


def test_a_draft_model_drafts_inside_the_grammar(stories, schema):
    """Masked drafts: where the draft model's own argmax leaves the grammar at once (story text
    where the schema wants '{"name": "'), its constrained chain stays inside it for the whole
    budget, alone and batched alike, and the request's grammar state is the same afterwards."""
    drafter = make_drafter("draft", stories, {"model": "truncated:2"})
    prompts = [prompt_of(stories, "Lily said:"), prompt_of(stories, "Once upon a time")]
    matchers = [schema.matcher() for _ in prompts]
    ctxs = [DraftContext(f"r{i}", p, 8, SamplingParams(), make_generator(0, 1), grammar=m)
            for i, (p, m) in enumerate(zip(prompts, matchers))]
    for ctx in ctxs:
        drafter.start(ctx.request_id, ctx.tokens)
    before = [m.allowed() for m in matchers]
    free = drafter.propose(replace(ctxs[0], grammar=None)).tokens[1:]
    assert matchers[0].valid_prefix(list(free)) == 0  # unconstrained, the grammar would cut it all
    alone = [drafter.propose(ctx) for ctx in ctxs]
    together = drafter.propose_batch(ctxs)
    for m, b, tree, batched in zip(matchers, before, alone, together):
        drafts = list(tree.tokens[1:])
        assert len(drafts) == 8 and m.valid_prefix(drafts) == 8
        assert batched.tokens == tree.tokens
        assert m.allowed().equal(b)
    assert stories.tokenizer.decode(list(alone[0].tokens[1:])).startswith('{"name": "')


def test_a_sampled_draft_models_q_is_the_masked_law(stories, schema):
    """Sampled drafts under a constraint come from the draft's masked distribution, and that q is
    what verification gets: zero on every token the grammar forbids at that depth."""
    drafter = make_drafter("draft", stories, {"model": "truncated:2"})
    prompt, m = prompt_of(stories, "Lily said:"), schema.matcher()
    drafter.start("s", prompt)
    ctx = DraftContext("s", prompt, 6, SamplingParams(temperature=1.0, seed=3), make_generator(3, 1), grammar=m)
    tree = drafter.propose(ctx)
    assert tree.draft_probs is not None and m.valid_prefix(list(tree.tokens[1:])) == tree.num_drafted
    for depth, token in enumerate(tree.tokens[1:]):
        allowed = m.allowed()
        q = tree.draft_probs[depth + 1]
        assert float(q[~allowed].sum()) == 0.0 and float(q[allowed].sum()) == pytest.approx(1.0, abs=1e-5)
        m.advance([token])
    m.rollback(tree.num_drafted)


def test_forced_tokens_join_a_draft_chain_without_a_draft_forward(stories, schema, monkeypatch):
    """The keys and punctuation a schema forces are drafted by the grammar, not by draft forwards:
    a chain that starts with them pays one draft forward per token the draft model chose."""
    drafter = make_drafter("draft", stories, {"model": "truncated:2"})
    prompt, m = prompt_of(stories, "Lily said:"), schema.matcher()
    drafter.start("r", prompt)
    calls = []
    forward = drafter.model.forward
    monkeypatch.setattr(drafter.model, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    forced = m.forced()
    tree = drafter.propose(DraftContext("r", prompt, 12, SamplingParams(), make_generator(0, 1), grammar=m))
    assert len(forced) >= 2 and list(tree.tokens[1:len(forced) + 1]) == forced
    assert tree.num_drafted == 12 and m.valid_prefix(list(tree.tokens[1:])) == 12
    assert len(calls) <= 12 - len(forced)


def test_forced_tokens_are_sized_by_the_cost_curve(stories, schema):
    """Free to draft is not free to verify: with a flat cost curve every forced token is drafted,
    with one where each verified token costs a whole step none pays, and in between the size
    follows how often the chain before them and the forced tokens themselves were accepted."""
    forced = schema.matcher().forced()
    assert len(forced) >= 4
    flat, steep = {n: 1.0 for n in (1, 2, 4, 8, 16)}, {n: 1.0 + n for n in (1, 2, 4, 8, 16)}
    assert jump_forward(DraftTree.chain(5, []), schema.matcher(), 16, JumpForward(flat)).num_drafted == len(forced)
    assert jump_forward(DraftTree.chain(5, []), schema.matcher(), 16, JumpForward(steep)).num_drafted == 0
    mid = {n: 1.0 + 0.2 * n for n in (1, 2, 4, 8, 16)}
    sizing = JumpForward(mid)
    before = sizing.size(0, 8)
    for _ in range(20):  # forced tokens always accepted: more of them pay
        sizing.shaped(0, 8)
        sizing.observe(8)
    assert sizing.size(0, 8) > before
    assert sizing.size(3, 8) >= sizing.size(6, 8)  # a longer chain before them is less likely to be all accepted
    learned = (sizing.size(0, 8), sizing.chain.node_values(8), sizing.forced.node_values(8))
    sizing.observe(3)  # a step with nothing shaped teaches nothing
    assert (sizing.size(0, 8), sizing.chain.node_values(8), sizing.forced.node_values(8)) == learned


def after_age(schema) -> object:
    """A matcher of ``schema`` past ``{"name": "Lily", "age": 3``: a number that may go on or end."""
    m = schema.matcher()
    assert m.advance(m.vocab.ll.tokenize_str('{"name": "Lily", "age": 3'))
    return m


def test_a_choice_ending_a_number_is_drafted_with_the_forced_run_after_it(stories, schema):
    m = after_age(schema)
    assert m.forced() == []  # another digit, or the `,` ending the number
    branches = forced_branches(m)
    assert branches and all(stories.tokenizer.decode(b).startswith(',') for b in branches)
    assert all(m.text(b) == b', "friends": [' for b in branches)
    tree = jump_forward(DraftTree.chain(7, []), m, budget=32)
    assert tree.num_drafted == sum(map(len, branches)) and not tree.is_chain  # one branch per `,` token
    assert list(tree.children[0]) == [1 + sum(map(len, branches[:i])) for i in range(len(branches))]
    assert m.forced() == [] and forced_branches(m) == branches  # the matcher's state is unchanged
    assert jump_forward(DraftTree.chain(7, []), m, budget=3).num_drafted == 3  # cut to the budget


def test_without_a_cost_curve_only_a_choice_with_one_way_on_is_branched(stories):
    choice = constraint_for(stories, "regex", r"(the|a) (big|red) (cat|dog|ball)")
    m = choice.matcher()
    assert m.advance(m.vocab.ll.tokenize_str("the"))
    assert sorted(m.text(b) for b in forced_branches(m)) == [b" big", b" red"]
    assert jump_forward(DraftTree.chain(7, []), m, 16).num_drafted == 0  # two guesses, nothing to weigh them by
    flat = {n: 1.0 for n in (1, 2, 4, 8, 16)}
    both = sum(map(len, forced_branches(m)))
    assert jump_forward(DraftTree.chain(7, []), m, 16, JumpForward(flat)).num_drafted == both  # on a flat curve


def test_branches_are_sized_by_the_cost_curve_and_how_often_they_win(stories, schema):
    m = after_age(schema)
    flat, steep = {n: 1.0 for n in (1, 2, 4, 8, 16, 32)}, {n: 1.0 + n for n in (1, 2, 4, 8, 16, 32)}
    assert jump_forward(DraftTree.chain(7, []), m, 32, JumpForward(flat)).num_drafted > 0
    assert jump_forward(DraftTree.chain(7, []), m, 32, JumpForward(steep)).num_drafted == 0
    mid = {n: 1.0 + 0.1 * n for n in (1, 2, 4, 8, 16, 32)}
    sizing = JumpForward(mid)
    n = len(forced_branches(m)[0])
    assert sizing.branches(0, 0, forced_branches(m)) >= 1
    for _ in range(30):  # the target never picks a drafted branch: they stop paying
        sizing.shaped(0, 0, True)
        sizing.observe(0)
    assert sizing.branches(0, 0, forced_branches(m)) == 0
    for _ in range(60):  # it picks the first every time
        sizing.shaped(0, 0, True)
        sizing.observe(n)
    assert sizing.branches(0, 0, forced_branches(m)) >= 1


def test_greedy_with_branches_equals_constrained_plain(stories, schema, monkeypatch):
    """Forced-only decoding with and without a choice's branches gives constrained plain's tokens;
    with them a number's end and the key after it take one target forward, not two."""
    params = SamplingParams(max_new_tokens=120, constraint=schema)
    prompt = prompt_of(stories, "Tom said: {\"name\": \"Tom\", \"age\": 12, \"friends\": [\"Sam\"]}")
    plain, plain_req = generate(stories, NoDrafter(), prompt, params, draft_limit=0)
    forwards = {}
    for branches in (0, speculation.MAX_BRANCHES):
        monkeypatch.setattr(speculation, "MAX_BRANCHES", branches)
        spec, req = generate(stories, NoDrafter(), prompt, params, k=32)
        assert spec == plain and req.finished == plain_req.finished == "eos"
        forwards[branches] = req.stats.target_forwards
    jsonschema.validate(json.loads(stories.tokenizer.decode(plain)), SCHEMA)
    assert forwards[branches] < forwards[0]


@pytest.mark.parametrize("curve", ["flat", "steep"])
def test_greedy_with_cost_sized_forced_tokens_equals_constrained_plain(stories, schema, curve):
    params = SamplingParams(max_new_tokens=120, constraint=schema)
    prompt = prompt_of(stories, "Lily said: {\"name\": \"Lily\", \"age\": 3}")
    plain, plain_req = generate(stories, NoDrafter(), prompt, params, draft_limit=0)
    engine = Engine(stories.backend, make_drafter("prompt-lookup", stories, {}), 8)
    engine.cost = CostModel({n: 1.0 if curve == "flat" else 1.0 + n for n in (1, 2, 4, 8)})
    req = engine.add_request(prompt, params)
    while not req.finished:
        engine.step(req)
    assert req.generated == plain and req.finished == plain_req.finished == "eos"
    assert req.stats.target_forwards <= plain_req.stats.target_forwards


def test_a_hybrids_retrieval_draft_the_grammar_forbids_leaves_the_step_to_the_draft_model(stories, schema):
    """The suffix draft (story text repeated in the prompt) is forbidden where the schema wants
    '{"name": "': under the grammar the hybrid sizes what the grammar leaves of it (nothing), so
    the draft model, masked, proposes instead of a draft the engine would cut to nothing."""
    hybrid = make_drafter("hybrid", stories, {"learned": "draft", "learned_model": "truncated:2", "budget": "fixed"})
    prompt = prompt_of(stories, "Lily said hello to the cat. Lily said hello to the cat. Lily said")
    m = schema.matcher()
    hybrid.start("r", prompt[:-1])  # the suffix drafter takes the prompt's last token as the step's root
    ctx = DraftContext("r", prompt, 6, SamplingParams(), make_generator(0, 1), grammar=m)
    free = hybrid.propose(replace(ctx, grammar=None))
    assert free.num_drafted > 0 and m.valid_prefix(list(free.tokens[1:])) == 0
    tree = hybrid.propose(ctx)
    assert tree.num_drafted == 6 and m.valid_prefix(list(tree.tokens[1:])) == 6


class _PromptCached(DraftModelDrafter):
    """A draft model whose prefix cache holds every prompt: starting a request prefills nothing."""

    def prefill_tokens(self, prompt_ids: list[int]) -> int:
        return 0


@pytest.mark.parametrize("catch_up_cost,max_new_tokens,cached,starts",
                         [(0.0, 16, False, True), (0.05, 16, False, False), (0.05, 120, False, True),
                          (0.05, 16, True, True)], ids=["free", "short", "long", "cached"])
def test_a_constrained_request_starts_the_draft_model_only_once_its_prefill_pays(stories, schema, catch_up_cost,
                                                                                  max_new_tokens, cached, starts):
    """Rent or buy (drafters/hybrid.py): the draft model's start is its prompt's prefill (36 tokens,
    ``catch_up_cost`` target steps each); every step the hybrid would ask it forgoes 1 - 1/r steps of
    saving (r = 1.46: its prior on a flat curve, 0.1 a draft forward), and it starts once those reach
    the prefill's cost. Free, it starts on the first ask; at 0.05 a token a 16-token answer (9 steps,
    suffix drafts and forced tokens) never starts it and a 71-token one does; a prompt its prefix cache
    holds starts it at once. Greedy output equals constrained plain decoding every time."""
    prompt = prompt_of(stories, 'Lily said: {"name": "Lily", "age": 3}. Once upon a time there was a cat.')
    params = SamplingParams(max_new_tokens=max_new_tokens, constraint=schema)
    plain, _ = generate(stories, NoDrafter(), prompt, params, draft_limit=0)
    flat = {n: 1.0 for n in (1, 2, 4, 8, 16)}
    draft = (_PromptCached if cached else DraftModelDrafter)(make_drafter("draft", stories, {"model": "truncated:2"}).model)
    hybrid = HybridDrafter(SuffixDecodingDrafter(min_score=0.0, max_global_tokens=0), draft, cost=flat,
                           learned_cost={n: 0.1 * n for n in flat}, learned_sizing="self", catch_up_cost=catch_up_cost)
    out, req = generate(stories, hybrid, prompt, params)
    assert out == plain
    assert (draft.fed_tokens > 0) == (hybrid.steps["learned"] > 0) == starts
    if not starts:  # the steps it would have been asked went to forced tokens
        assert hybrid.steps["none"] > 0 and req.stats.target_forwards < max_new_tokens
