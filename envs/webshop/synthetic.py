"""A synthetic WebShop catalog: same schema as the real 1k catalog, no data files needed.

Tests, CI and machines without ``$SERL_DATA_DIR`` still need a catalog the WebShop
environment (search, pages, goals, reward, expert) runs on unchanged, so every product
here carries exactly the processed keys of upstream ``load_products``. Products are built
from small per-category word lists: a handful of product types, each with its own scrape
query, category path, attribute pool and option kinds. Several products share each type,
so a search for "<type> <attribute>" returns the target among real competitors, as on
the 1k catalog. Everything is drawn from one ``random.Random(seed)``, so a (size, seed)
pair gives the same catalog on every machine and Python run.
"""

from __future__ import annotations

import random
import string

from envs.base import EnvError
from envs.webshop.catalog import Catalog, document_text

MIN_PRODUCTS = 10
SEP = " \u203a "  # upstream's category separator, "›" with spaces
INSTRUCTION_SHARE = 0.4  # 415 of the 1k products have a synthetic instruction
RANGE_SHARE = 0.1  # 93 of the 1k products have a price range
PER_TYPE = 5  # at least this many products per type when the catalog is small, so searches have competitors
ASIN_CHARS = string.ascii_uppercase + string.digits
IMAGE_URL = "https://example.com/webshop/images/{asin}-{k}.jpg"  # placeholder; nothing fetches it

# Option value pools, lower-case and free of '/' (upstream puts option values in URLs).
COLORS = ["black", "white", "navy blue", "gray", "red", "beige", "green", "pink", "brown", "rose gold"]
WEAR = ["x-small", "small", "medium", "large", "x-large", "xx-large"]
SHOES = ["6", "7", "7.5", "8", "8.5", "9", "10", "11", "12"]
VOLUME = ["2 fl oz", "4 fl oz", "8 fl oz", "16 fl oz", "32 fl oz"]
COUNT = ["1 count", "2 count", "4 count", "6 count", "12 count"]
WEIGHT = ["4 ounce", "8 ounce", "12 ounce", "1 pound", "2 pound"]
LENGTH = ["3 feet", "6 feet", "10 feet", "15 feet", "25 feet"]
SCENTS = ["unscented", "lavender", "coconut", "citrus", "mint", "rose"]
FLAVORS = ["original", "chocolate", "vanilla", "strawberry", "sea salt", "honey"]
# No non-color value may contain a color name: the reward normalizes "rustic" to "rust"
# and then misses the goal option, so even the target product would score below 1.
STYLES = ["classic", "modern", "industrial", "minimalist", "vintage"]

# category -> (category path root, price band, brands, materials, product types).
# A type is (noun in titles, scrape query, path below the root, attribute pool, option kinds).
CATALOG = {
    "beauty": (
        "Beauty & Personal Care",
        (5.0, 60.0),
        ["Lumora", "Verdana", "Puressa", "Oakleaf"],
        ["argan oil", "aloe vera", "shea butter", "tea tree oil"],
        [
            (
                "shampoo",
                "shampoo",
                "Hair Care › Shampoo & Conditioner › Shampoos",
                ["sulfate free", "paraben free", "long lasting", "dry hair", "natural ingredients", "color safe"],
                {"size": VOLUME, "scent": SCENTS},
            ),
            (
                "face moisturizer",
                "face moisturizers",
                "Skin Care › Face › Moisturizers",
                ["fragrance free", "sensitive skin", "cruelty free", "non greasy", "anti aging"],
                {"size": VOLUME},
            ),
            (
                "lipstick",
                "lipstick",
                "Makeup › Lips › Lipstick",
                ["long lasting", "cruelty free", "matte finish", "highly pigmented", "easy carry"],
                {"color": COLORS},
            ),
            (
                "hair dryer",
                "hair dryers",
                "Hair Care › Styling Tools & Appliances › Hair Dryers",
                ["fast drying", "low noise", "lightweight", "easy carry", "high quality"],
                {"color": COLORS},
            ),
        ],
    ),
    "electronics": (
        "Electronics",
        (15.0, 200.0),
        ["Voltrix", "Sonique", "Kestrel", "Novatek"],
        ["aluminum", "abs plastic", "braided nylon", "tempered glass"],
        [
            (
                "wireless earbuds",
                "wireless earbuds",
                "Headphones, Earbuds & Accessories › Earbud Headphones",
                ["noise cancelling", "water resistant", "fast charging", "long battery life", "hands free"],
                {"color": COLORS},
            ),
            (
                "hdmi cable",
                "hdmi cables",
                "Accessories & Supplies › Audio & Video Accessories › Cables › HDMI Cables",
                ["high speed", "gold plated", "ultra hd", "heavy duty"],
                {"size": LENGTH},
            ),
            (
                "portable charger",
                "portable chargers",
                "Cell Phones & Accessories › Chargers & Power Adapters › Portable Power Banks",
                ["fast charging", "usb c", "lightweight", "high capacity", "easy carry"],
                {"color": COLORS},
            ),
            (
                "bluetooth speaker",
                "bluetooth speakers",
                "Portable Audio & Video › Portable Speakers",
                ["water resistant", "long battery life", "stereo sound", "hands free", "easy carry"],
                {"color": COLORS, "style": STYLES},
            ),
        ],
    ),
    "garden": (
        "Home & Kitchen",
        (10.0, 200.0),
        ["Hearthwood", "Greenfield", "Maplecrest", "Terrano"],
        ["acacia wood", "stainless steel", "ceramic", "cotton canvas"],
        [
            (
                "throw pillow cover",
                "decorative pillows",
                "Home Décor › Decorative Pillows, Inserts & Covers › Throw Pillow Covers",
                ["machine washable", "super soft", "hidden zipper", "living room"],
                {"color": COLORS, "size": ["16 x 16 inch", "18 x 18 inch", "20 x 20 inch"]},
            ),
            (
                "garden hose",
                "garden hoses",
                "Patio, Lawn & Garden › Watering Equipment › Garden Hoses",
                ["heavy duty", "lightweight", "kink free", "easy install"],
                {"size": LENGTH},
            ),
            (
                "storage shelf",
                "storage shelves",
                "Storage & Organization › Racks, Shelves & Drawers › Standing Shelf Units",
                ["easy assemble", "heavy duty", "rust resistant", "space saving"],
                {"size": ["3 shelves", "4 shelves", "5 shelves"], "color": COLORS},
            ),
            (
                "coffee mug",
                "coffee mugs",
                "Kitchen & Dining › Dining & Entertaining › Cups, Mugs & Saucers › Mugs",
                ["dishwasher safe", "microwave safe", "bpa free", "large capacity"],
                {"color": COLORS, "size": ["12 ounce", "16 ounce", "20 ounce"]},
            ),
        ],
    ),
    "fashion": (
        "Clothing, Shoes & Jewelry",
        (10.0, 120.0),
        ["Northway", "Velour & Vine", "Stride", "Cobalt Row"],
        ["cotton", "polyester", "leather", "merino wool"],
        [
            (
                "running shoes",
                "men's running shoes",
                "Men › Shoes › Athletic › Running",
                ["non slip", "breathable", "lightweight", "rubber sole", "arch support"],
                {"size": SHOES, "color": COLORS},
            ),
            (
                "t-shirt",
                "women's t-shirts",
                "Women › Clothing › Tops, Tees & Blouses › T-Shirts",
                ["machine wash", "short sleeve", "relaxed fit", "soft material"],
                {"size": WEAR, "color": COLORS},
            ),
            (
                "winter jacket",
                "men's jackets & coats",
                "Men › Clothing › Jackets & Coats",
                ["water resistant", "warm lining", "zipper closure", "hooded"],
                {"size": WEAR, "color": COLORS},
            ),
            (
                "crossbody bag",
                "women's handbags",
                "Women › Handbags & Wallets › Cross-Body Bags",
                ["adjustable strap", "easy carry", "vegan leather", "multiple pockets"],
                {"color": COLORS},
            ),
        ],
    ),
    "grocery": (
        "Grocery & Gourmet Food",
        (5.0, 50.0),
        ["Harvest Lane", "Goldcrest", "Tidewell", "Sunmeadow"],
        ["whole grain", "almond flour", "dark chocolate", "sea salt"],
        [
            (
                "protein bar",
                "protein bars",
                "Snacks & Sweets › Snack Bars › Protein Bars",
                ["gluten free", "low sugar", "high protein", "non gmo"],
                {"flavor": FLAVORS, "size": COUNT},
            ),
            (
                "green tea",
                "green tea",
                "Beverages › Coffee, Tea & Cocoa › Tea › Green",
                ["caffeine free", "organic", "individually wrapped", "non gmo"],
                {"size": COUNT},
            ),
            (
                "potato chips",
                "potato chips",
                "Snacks & Sweets › Snack Foods › Chips & Crisps › Potato",
                ["gluten free", "kettle cooked", "no artificial flavors", "vegan"],
                {"flavor": FLAVORS, "size": WEIGHT},
            ),
            (
                "peanut butter",
                "peanut butter",
                "Pantry Staples › Jams, Jellies & Sweet Spreads › Nut Butters › Peanut Butter",
                ["sugar free", "non gmo", "high protein", "gluten free"],
                {"size": WEIGHT},
            ),
        ],
    ),
}
TYPES = [
    (cat, root, band, brands, materials, *kind)
    for cat, (root, band, brands, materials, kinds) in CATALOG.items()
    for kind in kinds
]

ADJECTIVES = ["Premium", "Classic", "Ultra", "Professional", "Deluxe", "Everyday", "Original", "Advanced"]
DESCRIPTIONS = [
    "The {brand} {noun} is {attrs}. Made with {material} for everyday use.",
    "Meet our {adj} {noun}: {attrs}, and built with {material} to last.",
    "{brand} designs every {noun} to be {attrs}. {Material} keeps it reliable day after day.",
]
BULLETS = [
    "{Attr}: every {noun} from {brand} is {attr}, tested for quality",
    "{Attr} by design, so the {noun} works the way you expect",
]
EXTRA_BULLETS = [
    "Material: {material}",
    "What you get: one {noun} and a {brand} quality guarantee",
    "Easy to use: ready out of the box, no tools needed",
    "Customer care: contact {brand} with any question and we will reply within 24 hours",
]
# Built on the (plural) scrape query, so no article is needed, and with "with", which reads
# right for both kinds of attribute phrase ("sulfate free", "rubber sole") -- as in the 1k
# file's "Find me scrubs & body treatments with tea tree, natural ingredients".
INSTRUCTIONS = [
    "i need {query} with {attrs}",
    "i am looking for {query} with {attrs}",
    "find me {query} with {attrs}",
]


def _join(phrases: list[str]) -> str:
    """'a', 'a and b', 'a, b and c' -- reads like the 1k instructions."""
    return phrases[0] if len(phrases) == 1 else ", ".join(phrases[:-1]) + " and " + phrases[-1]


def _price(rng: random.Random, band: tuple[float, float]) -> list[float]:
    lo, hi = band
    if rng.random() < RANGE_SHARE:
        # ranges need headroom: start at most 30 below the band top, widen by 2..30
        start = round(rng.uniform(lo, hi - 30.0), 2)
        return [start, round(start + rng.uniform(2.0, 30.0), 2)]
    return [round(rng.uniform(lo, hi), 2)]


def _options(rng: random.Random, kinds: dict[str, list[str]]) -> dict[str, list[str]]:
    # near the 1k shares: 58% no options, 25% one option name, 18% two or three
    r = rng.random()
    n = 0 if r < 0.55 else 1 if r < 0.85 or len(kinds) < 2 else 2
    options = {}
    for name in rng.sample(sorted(kinds), n):
        pool = kinds[name]
        picked = rng.sample(pool, rng.randint(2, min(5, len(pool))))
        options[name] = sorted(picked, key=pool.index)  # keep the pool's natural order (small < large)
    return options


def _new_asin(rng: random.Random, taken: set[str]) -> str:
    while True:
        asin = "B0" + "".join(rng.choices(ASIN_CHARS, k=8))
        if asin not in taken:
            taken.add(asin)
            return asin


def _product(rng: random.Random, kind: tuple, asin: str) -> dict:
    category, root, band, brands, materials, noun, query, path, attr_pool, option_kinds = kind
    brand, adj, material = rng.choice(brands), rng.choice(ADJECTIVES), rng.choice(materials)
    attributes = rng.sample(attr_pool, rng.randint(1, min(4, len(attr_pool))))
    fill = dict(brand=brand, adj=adj.lower(), noun=noun, material=material, Material=material.capitalize())

    title = f"{brand} {adj} {attributes[0].title()} {noun.title()}"
    if len(attributes) > 1:
        title += f", {attributes[1].title()}"
    if rng.random() < 0.3:
        title += f", Pack of {rng.choice([2, 3, 4])}"
    # every attribute appears in the indexed text, so BM25 on "<type> <attribute>" finds the product
    description = rng.choice(DESCRIPTIONS).format(attrs=_join(attributes), **fill)
    bullets = [rng.choice(BULLETS).format(attr=a, Attr=a.capitalize(), **fill) for a in attributes]
    bullets += [b.format(**fill) for b in rng.sample(EXTRA_BULLETS, rng.randint(0, 2))]
    options = _options(rng, option_kinds)
    pricing = _price(rng, band)
    images = [IMAGE_URL.format(asin=asin, k=k) for k in range(rng.randint(2, 5))]
    # Key order and types as in documents_1k.jsonl (upstream's processed dicts).
    return {
        "name": title,
        "full_description": description,
        "pricing": pricing,
        "images": images,
        "product_category": SEP.join([root, *path.split(" › ")]),
        "average_rating": "",
        "small_description": bullets,
        "customization_options": "",
        "asin": asin,
        "category": category,
        "query": query,
        "page": rng.randint(1, 400),
        "Title": title,
        "Description": description,
        "Reviews": [],
        "Rating": "N.A.",
        "BulletPoints": bullets,
        # upstream load_products formats the floats as they are: "$35.0", "$19.99 to $27.99"
        "Price": f"${pricing[0]}" if len(pricing) == 1 else f"${pricing[0]} to ${pricing[1]}",
        "options": options,
        # upstream maps each option value to its swatch image; None where there is none
        "option_to_image": {v: None for values in options.values() for v in values},
        "Attributes": attributes,
        "MainImage": images[0],
    }


def _instruction(rng: random.Random, product: dict) -> dict:
    wanted = rng.sample(product["Attributes"], rng.randint(1, min(3, len(product["Attributes"]))))
    text = rng.choice(INSTRUCTIONS).format(query=product["query"], attrs=_join(wanted))
    return {"attributes": list(product["Attributes"]), "instruction": text, "instruction_attributes": wanted}


def make_synthetic_catalog(num_products: int = 200, seed: int = 0) -> Catalog:
    """A deterministic catalog of ``num_products`` products; ~40% of them carry an instruction."""
    if num_products < MIN_PRODUCTS:
        raise EnvError(f"synthetic WebShop catalog needs at least {MIN_PRODUCTS} products, got {num_products}")
    rng = random.Random(seed)
    # Small catalogs use fewer types, so each type still has PER_TYPE products competing in search.
    kinds = rng.sample(TYPES, max(2, min(len(TYPES), num_products // PER_TYPE)))
    taken: set[str] = set()
    products = [_product(rng, kinds[i % len(kinds)], _new_asin(rng, taken)) for i in range(num_products)]
    rng.shuffle(products)  # the 1k file is in scrape-shuffled order, not grouped by type

    # An exact share (not a coin per product) so even a 10-product catalog has goals.
    with_goal = set(rng.sample(range(num_products), round(INSTRUCTION_SHARE * num_products)))
    instructions = {
        p["asin"]: _instruction(rng, p) if i in with_goal else {"attributes": list(p["Attributes"])}
        for i, p in enumerate(products)
    }
    return Catalog(
        products=products,
        texts=[document_text(p) for p in products],
        instructions=instructions,
        source=f"synthetic:n={num_products},seed={seed}",
    )
