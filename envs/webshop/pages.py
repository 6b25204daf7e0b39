"""WebShop's pages in text mode: what a page shows and what on it can be clicked.

Upstream renders HTML templates (``web_agent_site/templates/*.html``) and the text
environment joins the page's visible strings with `` [SEP] `` and collects buttons,
product links and option radios as clickables (``web_agent_text_env.py``). serl keeps the
page as a small state record and renders the same strings directly:

- start:   ``WebShop [SEP] Instruction: [SEP] <goal> [SEP] Search``
- results: instruction, ``Back to Search``, ``Page N (Total results: T)``, ``< Prev`` (past
  page 1), ``Next >`` (always, as upstream), then ASIN, title and price of up to 10 items
- item:    instruction, ``Back to Search``, ``< Prev``, each option name and its values,
  title, ``Price: ...``, ``Rating: ...``, ``Description``, ``Features``, ``Reviews``, ``Buy Now``
- description / features / reviews: instruction, ``Back to Search``, ``< Prev``, the text
- done:    ``Thank you for shopping with us! [SEP] Your score (min 0.0, max 1.0) [SEP] <r>``
  (upstream's done page also prints hidden debugging fields; serl shows only the score)

Empty strings are dropped, as a browser shows nothing for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRODUCTS_PER_PAGE = 10  # upstream PRODUCT_WINDOW
SEP = " [SEP] "

BACK_TO_SEARCH = "back to search"
PREV = "< prev"
NEXT = "next >"
BUY_NOW = "buy now"
SUB_PAGES = ("description", "features", "reviews")


@dataclass
class PageState:
    """Everything that decides what the screen shows."""

    page: str = "start"  # start | results | item | description | features | reviews | done
    query: str = ""
    hits: list[int] = field(default_factory=list)  # catalog indices of the search results, best first
    results_page: int = 1
    asin: str | None = None
    options: dict[str, str] = field(default_factory=dict)  # option name -> chosen value
    reward: float = 0.0

    def listed(self) -> list[int]:
        """Catalog indices shown on the current results page."""
        start = (self.results_page - 1) * PRODUCTS_PER_PAGE
        return self.hits[start : start + PRODUCTS_PER_PAGE]

    def product_asin(self) -> str:
        """The product an item page, its sub-pages and the done page are about (set by the click
        on its link, kept until back to the results)."""
        if self.asin is None:
            raise ValueError(f"a {self.page} page without a product (asin is None)")
        return self.asin

    def copy(self) -> PageState:
        return PageState(
            self.page, self.query, self.hits, self.results_page, self.asin, dict(self.options), self.reward
        )


def render(state: PageState, instruction: str, products: list[dict], by_asin: dict[str, dict]) -> str:
    """The observation: the page's visible strings joined with [SEP]."""
    header = ["Instruction:", instruction, "Back to Search"]
    if state.page == "start":
        parts = ["WebShop", "Instruction:", instruction, "Search"]
    elif state.page == "results":
        parts = header + [f"Page {state.results_page} (Total results: {len(state.hits)})"]
        parts += (["< Prev"] if state.results_page > 1 else []) + ["Next >"]
        for i in state.listed():
            p = products[i]
            parts += [p["asin"], p["Title"], p["Price"]]
    elif state.page == "item":
        p = by_asin[state.product_asin()]
        parts = header + ["< Prev"]
        for name, values in p["options"].items():
            parts += [name, *values]
        parts += [
            p["Title"],
            f"Price: {p['Price']}",
            f"Rating: {p['Rating']}",
            "Description",
            "Features",
            "Reviews",
            "Buy Now",
        ]
    elif state.page == "description":
        parts = header + ["< Prev", by_asin[state.product_asin()]["Description"]]
    elif state.page == "features":
        parts = header + ["< Prev", *by_asin[state.product_asin()]["BulletPoints"]]
    elif state.page == "reviews":
        parts = header + ["< Prev"]  # the 1k catalog carries no reviews
    elif state.page == "done":
        parts = ["Thank you for shopping with us!", "Your score (min 0.0, max 1.0)", str(state.reward)]
    else:
        raise ValueError(f"unknown page {state.page!r}")
    return SEP.join(s for s in (part.strip() for part in parts) if s)


def clickables(state: PageState, products: list[dict], by_asin: dict[str, dict]) -> dict[str, tuple[str, str | None]]:
    """Lower-cased clickable text -> (kind, option name). Kinds: button, product, option.

    As upstream, buttons and product links come first and option values after, keyed by
    the (already lower-cased) value; a value repeated under two option names maps to the
    last one.
    """
    out: dict[str, tuple[str, str | None]] = {}
    if state.page == "start":
        out["search"] = ("button", None)
    elif state.page == "results":
        out[BACK_TO_SEARCH] = ("button", None)
        if state.results_page > 1:
            out[PREV] = ("button", None)
        out[NEXT] = ("button", None)
        for i in state.listed():
            out[products[i]["asin"].lower()] = ("product", None)
    elif state.page == "item":
        for b in (BACK_TO_SEARCH, PREV, *SUB_PAGES, BUY_NOW):
            out[b] = ("button", None)
        for name, values in by_asin[state.product_asin()]["options"].items():
            for v in values:
                out[v] = ("option", name)
    elif state.page in SUB_PAGES:
        out[BACK_TO_SEARCH] = ("button", None)
        out[PREV] = ("button", None)
    return out


def describe_change(before: PageState, after: PageState, products: list[dict]) -> str:
    """The ``diff`` feedback: page type before and after, and what appeared or vanished."""
    notes = []
    if before.page != after.page:
        notes.append(f"page {before.page} -> {after.page}")
    if after.page == "results" and (after.query != before.query or after.hits is not before.hits):
        notes.append(f"search '{after.query}' gave {len(after.hits)} results")
    if after.page == "results" and before.page == "results" and after.results_page != before.results_page:
        notes.append(f"results page {before.results_page} -> {after.results_page}")
    shown_before = {products[i]["asin"] for i in before.listed()} if before.page == "results" else set()
    shown_after = [products[i]["asin"] for i in after.listed()] if after.page == "results" else []
    appeared = [a for a in shown_after if a not in shown_before]
    vanished = sorted(shown_before - set(shown_after)) if after.page == "results" else []
    if appeared:
        notes.append("listed: " + ", ".join(appeared))
    if vanished:
        notes.append("no longer listed: " + ", ".join(vanished))
    if after.page == "results" and not shown_after:
        notes.append("no items on this page")
    if after.asin != before.asin and after.asin is not None and after.page == "item":
        notes.append(f"opened {after.asin}")
    for name, value in after.options.items():
        if before.options.get(name) != value:
            was = before.options.get(name)
            notes.append(f"selected {name}: {value}" + (f" (was {was})" if was else ""))
    for name in sorted(before.options.keys() - after.options.keys()):  # a set: its order is not the run's
        notes.append(f"cleared {name}")
    if after.page == "done":
        notes.append(f"bought {after.asin}, score {after.reward:.3f}")
    return "; ".join(notes) if notes else "no change"
