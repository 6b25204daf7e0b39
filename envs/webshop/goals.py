"""WebShop's synthetic goals and the fixed train/test split.

A goal exists for every product that has a synthetic instruction and for every
combination of its option values (upstream ``get_synthetic_goals`` in
``web_agent_site/engine/goal.py``): the instruction, then " with NAME: VALUE, and ..."
(names sorted), then a price clause. The 1k catalog gives 6,910 goals.

Randomness, fixed once and documented here (upstream draws it from the global ``random``
state, which depends on import order, so its exact draws cannot be reproduced):

- the purchase price of a product with a price range is drawn uniformly in the range,
  and the price bound of each product's goals is drawn, both from one
  ``random.Random(GOAL_SEED)`` walked in catalog order;
- the goal list is then shuffled once with ``random.Random(GOAL_SEED)``.

Test is goals 0-499 of the shuffled list and train the rest, the convention of
verl-agent and the paper. Nothing depends on the machine or the worker count.
"""

from __future__ import annotations

import itertools
import random

from envs.base import EnvError
from envs.webshop.catalog import Catalog

GOAL_SEED = 233  # upstream's SimServer shuffles its goals after random.seed(233)
PRICE_POINTS = [10.0 * i for i in range(1, 100)]  # 10, 20, ..., 990
NO_PRICE_BOUND = 1_000_000.0
TEST_SIZE = 500
SPLITS = ("test", "train")


def purchase_prices(catalog: Catalog, rng: random.Random) -> dict[str, float]:
    """The price a purchase is charged: the listed price, or a uniform draw within a price range."""
    prices = {}
    for product in catalog.products:
        pricing = product.get("pricing") or [100.0]
        prices[product["asin"]] = pricing[0] if len(pricing) == 1 else rng.uniform(*pricing[:2])
    return prices


def price_bound(price: float, rng: random.Random) -> tuple[float, str]:
    """Of the first four price points above the price, sample two; the larger is the bound."""
    above = [p for p in PRICE_POINTS if p > price][:4]
    if len(above) < 2:
        return NO_PRICE_BOUND, ""
    upper = max(rng.sample(above, 2))
    return upper, f", and price lower than {upper:.2f} dollars"


def build_goals(catalog: Catalog) -> tuple[list[dict], dict[str, float]]:
    """All synthetic goals of a catalog, shuffled with GOAL_SEED, and the purchase prices."""
    rng = random.Random(GOAL_SEED)
    prices = purchase_prices(catalog, rng)
    goals = []
    for product in catalog.products:
        ins = catalog.instructions.get(product["asin"], {})
        if not ins.get("instruction"):
            continue
        upper, price_text = price_bound(prices[product["asin"]], rng)
        names = sorted(product["options"])
        for combination in itertools.product(*(product["options"][n] for n in names)):
            goal_options = dict(zip(names, combination, strict=True))
            option_text = ", and ".join(f"{k}: {v}" for k, v in goal_options.items())
            goals.append(
                {
                    "asin": product["asin"],
                    "category": product["category"],
                    "query": product["query"],
                    # upstream overwrites the goal's name with the product Title
                    "name": product["Title"],
                    "product_category": product["product_category"],
                    "instruction_text": ins["instruction"]
                    + (f" with {option_text}" if option_text else "")
                    + price_text,
                    "attributes": ins["instruction_attributes"],
                    "price_upper": upper,
                    "goal_options": goal_options,
                }
            )
    random.Random(GOAL_SEED).shuffle(goals)
    return goals, prices


def split_indices(num_goals: int, split: str) -> range:
    """Goal indices of a split: test = 0..499, train = the rest."""
    test_size = min(TEST_SIZE, num_goals // 2) if num_goals < 2 * TEST_SIZE else TEST_SIZE
    if split == "test":
        return range(0, test_size)
    if split == "train":
        return range(test_size, num_goals)
    raise EnvError(f"unknown WebShop split {split!r}: choose one of {', '.join(SPLITS)}")
