"""The synthetic WebShop catalog: deterministic, and the same schema as the real 1k catalog."""

import gc
import json
import os
import random
import re
import timeit
from pathlib import Path

import pytest

from envs.base import EnvError
from envs.webshop.catalog import DATA_ENV_VAR, DOCUMENTS_FILE, Catalog, document_text
from envs.webshop.synthetic import make_synthetic_catalog

CATEGORIES = {"beauty", "electronics", "garden", "fashion", "grocery"}


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return make_synthetic_catalog(num_products=200, seed=0)


@pytest.fixture(scope="module")
def big() -> Catalog:
    return make_synthetic_catalog(num_products=1000, seed=3)


def as_tuple(c: Catalog):
    return c.products, c.texts, c.instructions, c.source


def test_deterministic_and_seed_dependent(catalog):
    assert as_tuple(make_synthetic_catalog(200, 0)) == as_tuple(catalog)
    other = make_synthetic_catalog(200, 1)
    assert other.products != catalog.products
    assert {p["asin"] for p in other.products}.isdisjoint({p["asin"] for p in catalog.products})


def test_ignores_and_keeps_global_random_state():
    random.seed(1)
    first = make_synthetic_catalog(50, 7)
    random.seed(2)
    state = random.getstate()
    second = make_synthetic_catalog(50, 7)
    assert as_tuple(first) == as_tuple(second)
    assert random.getstate() == state


@pytest.mark.parametrize("n", [10, 57, 200, 1000])
def test_size_and_source(n):
    c = make_synthetic_catalog(n, seed=5)
    assert len(c) == len(c.texts) == len(c.instructions) == n
    assert list(c.instructions) == [p["asin"] for p in c.products]
    assert c.source == f"synthetic:n={n},seed=5"
    # an exact 40% share, so even the smallest catalog has goals
    assert sum("instruction" in v for v in c.instructions.values()) == round(0.4 * n)


def test_asins_unique_and_well_formed(big):
    asins = [p["asin"] for p in big.products]
    assert len(set(asins)) == len(asins)
    assert all(re.fullmatch(r"B0[A-Z0-9]{8}", a) for a in asins)
    assert set(big.by_asin) == set(asins)


def test_keys_match_a_real_product(catalog):
    root = os.environ.get(DATA_ENV_VAR)
    path = Path(root or ".") / "webshop" / DOCUMENTS_FILE
    if not root or not path.is_file():
        pytest.skip(f"needs the real catalog: set {DATA_ENV_VAR} to the folder holding webshop/{DOCUMENTS_FILE}")
    with open(path, encoding="utf-8") as f:
        real = json.loads(f.readline())["product"]
    for p in catalog.products:
        assert list(p) == list(real)  # same keys in the same order
        for key, value in real.items():
            assert type(p[key]) is type(value), key


def test_texts_are_document_text(big):
    assert big.texts == [document_text(p) for p in big.products]


def test_field_values(big):
    for p in big.products:
        assert p["name"] == p["Title"] and p["full_description"] == p["Description"]
        assert p["small_description"] == p["BulletPoints"] and len(p["BulletPoints"]) >= 1
        assert p["Attributes"] and all(a == a.lower() for a in p["Attributes"])
        assert p["category"] in CATEGORIES and p["query"] == p["query"].lower()
        levels = p["product_category"].split(" \u203a ")
        assert len(levels) >= 3 and all(levels) and "›" not in "".join(levels)
        assert p["Rating"] == "N.A." and p["Reviews"] == [] and p["average_rating"] == ""
        assert p["customization_options"] == "" and isinstance(p["page"], int)
        assert p["images"] and p["MainImage"] == p["images"][0]


def test_options(big):
    counts = {0: 0, 1: 0, 2: 0}
    for p in big.products:
        counts[len(p["options"])] += 1
        for name, values in p["options"].items():
            assert name == name.lower() and 2 <= len(values) <= 5 and len(set(values)) == len(values)
            assert all(v == v.lower() and "/" not in v for v in values)
        assert set(p["option_to_image"]) == {v for vs in p["options"].values() for v in vs}
    assert all(counts.values()), counts  # some products with none, one and two option names


def test_prices(big):
    ranges = 0
    for p in big.products:
        pricing = p["pricing"]
        assert len(pricing) in (1, 2) and all(isinstance(x, float) and 5 <= x <= 200 for x in pricing)
        assert all(round(x, 2) == x for x in pricing)
        if len(pricing) == 1:
            assert p["Price"] == f"${pricing[0]}"
        else:
            ranges += 1
            assert pricing[0] < pricing[1] and p["Price"] == f"${pricing[0]} to ${pricing[1]}"
        assert re.fullmatch(r"\$\d+\.\d{1,2}( to \$\d+\.\d{1,2})?", p["Price"])
    assert 50 <= ranges <= 150  # about 10%


def test_instructions(big):
    for asin, ins in big.instructions.items():
        product = big.by_asin[asin]
        assert ins["attributes"] == product["Attributes"]
        if "instruction" in ins:
            assert ins["instruction"] == ins["instruction"].lower()
            assert ins["instruction_attributes"] and set(ins["instruction_attributes"]) <= set(ins["attributes"])
            assert all(a in ins["instruction"] for a in ins["instruction_attributes"])
        else:
            assert set(ins) == {"attributes"}


def test_types_share_query_and_category(catalog):
    by_query: dict[str, set] = {}
    for p in catalog.products:
        by_query.setdefault(p["query"], set()).add((p["product_category"], p["category"]))
    assert all(len(paths) == 1 for paths in by_query.values())
    sizes = [sum(p["query"] == q for p in catalog.products) for q in by_query]
    assert min(sizes) >= 5  # several products per type, so searches have competitors


def test_search_finds_the_target(catalog):
    search = pytest.importorskip("envs.webshop.search")
    engine = search.SearchEngine(catalog.texts)
    index = {p["asin"]: i for i, p in enumerate(catalog.products)}
    found = total = 0
    for asin, ins in catalog.instructions.items():
        if "instruction" in ins:
            # product type + its attributes, as an agent would search (possessives left out)
            query = catalog.by_asin[asin]["query"].replace("'s", "") + " " + " ".join(ins["instruction_attributes"])
            hits = engine.search(query)
            total += 1
            found += index[asin] in hits
            assert sum(catalog.products[h]["query"] == catalog.by_asin[asin]["query"] for h in hits) >= 3
    assert found / total >= 0.95


def test_buying_the_target_scores_full_reward(catalog):
    # guards the word lists: e.g. an option value holding a color name ("rustic" > "rust")
    # would be normalized away by the reward and cost even the right purchase
    goals_mod = pytest.importorskip("envs.webshop.goals")
    reward = pytest.importorskip("envs.webshop.reward")
    goals, prices = goals_mod.build_goals(catalog)
    assert len(goals) >= round(0.4 * len(catalog))
    for g in goals:
        assert reward.total_reward(catalog.by_asin[g["asin"]], g, prices[g["asin"]], g["goal_options"]) == 1.0, g


@pytest.mark.parametrize("n", [9, 0, -3])
def test_too_small_is_an_error(n):
    with pytest.raises(EnvError, match="at least 10 products"):
        make_synthetic_catalog(num_products=n)


def test_generation_is_fast():
    # Garbage collection off while timing: with a large heap (spaCy loaded by other tests)
    # gen-2 collections alone take several times the generation's own ~30 ms.
    gc.collect()
    gc.disable()
    try:
        best = min(timeit.repeat(lambda: make_synthetic_catalog(num_products=1000, seed=11), number=1, repeat=3))
    finally:
        gc.enable()
    assert best < 0.5


def test_the_diff_names_cleared_options_in_one_order_whatever_the_hash_seed():
    """Options cleared at once are named sorted: a set's order changes with PYTHONHASHSEED, and a
    recorded feedback would then differ between two runs of the same command."""
    import subprocess
    import sys

    code = (
        "from envs.webshop.pages import PageState, describe_change; "
        "b = PageState(page='item', asin='B1', options={n: 'x' for n in ('size', 'color', 'style', 'fit', 'pack')}); "
        "print(describe_change(b, PageState(page='start'), []))"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONHASHSEED": str(seed)}, check=True
        ).stdout
        for seed in range(6)
    }
    assert outputs == {"page item -> start; cleared color; cleared fit; cleared pack; cleared size; cleared style\n"}
