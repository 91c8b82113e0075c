"""A copy-heavy prompt set for speculative decoding (issue 35): answers that copy long spans of
their prompt, where drafts from the prompt's own tokens are right.

50 chat prompts, built from fixed parts (no data file, no randomness at import):
- 25 code edits: a small Python file and an edit (a rename, a changed constant, an added line);
  the answer is the changed file;
- 25 quoting tasks: a passage of prose and a request to repeat it, or to summarise it quoting its
  sentences word for word.
"""

from __future__ import annotations

_FUNCS = [
    ("add", "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n    return a + b\n"),
    ("scale", "def scale(values, factor):\n    return [v * factor for v in values]\n"),
    ("clamp", "def clamp(x, low, high):\n    if x < low:\n        return low\n    if x > high:\n        return high\n    return x\n"),
    ("mean", "def mean(values):\n    if not values:\n        raise ValueError(\"mean of an empty list\")\n    return sum(values) / len(values)\n"),
    ("read_lines", "def read_lines(path):\n    with open(path) as f:\n        return [line.rstrip(\"\\n\") for line in f]\n"),
    ("count_words", "def count_words(text):\n    counts = {}\n    for word in text.split():\n        counts[word] = counts.get(word, 0) + 1\n    return counts\n"),
    ("is_even", "def is_even(n):\n    return n % 2 == 0\n"),
    ("greet", "def greet(name):\n    return f\"Hello, {name}!\"\n"),
    ("flatten", "def flatten(rows):\n    out = []\n    for row in rows:\n        out.extend(row)\n    return out\n"),
    ("max_index", "def max_index(values):\n    best = 0\n    for i, v in enumerate(values):\n        if v > values[best]:\n            best = i\n    return best\n"),
]

_EDITS = [
    "Rename the function `{f}` to `{f}_v2` everywhere and return the whole file.",
    "Add the line `# reviewed` at the top of the file and return the whole file.",
    "Return the whole file unchanged except that the function `{f}` gets a docstring.",
    "Rewrite the file with 4-space indentation kept and the function `{f}` moved to the end.",
    "Copy the file exactly, then add a function `main()` that calls `{f}`.",
]

_SENTENCES = [
    "The river rises in the northern hills and runs for two hundred miles before it reaches the sea.",
    "Farmers along its banks grow wheat, barley and apples, and sell them in the market towns.",
    "In the spring the water is high and fast, and the old stone bridges are sometimes closed.",
    "A railway was built beside the river in 1860, and it still carries goods and passengers today.",
    "The largest town on the river has a cathedral, a university and a busy harbour.",
    "Every summer a boat race is held between the two oldest colleges of the university.",
    "The library keeps maps of the river that are more than four hundred years old.",
    "Scientists measure the water every week to check that it stays clean for the fish.",
    "Otters returned to the river in 1995 after an absence of almost forty years.",
    "Walkers can follow a path along the whole river, staying at inns on the way.",
    "The company was founded in 1972 by two engineers who built radios in a garage.",
    "Its first product was a small transistor radio that sold for twelve dollars.",
    "By 1985 the company employed three thousand people in four countries.",
    "The founders believed that every product should be simple to repair.",
    "Today the company makes sensors for cars, trains and aircraft.",
]

_QUOTES = [
    "Repeat the text above exactly, word for word.",
    "Summarise the text above in a few sentences, quoting its sentences word for word.",
    "Copy the text above, then list its three most important sentences.",
    "Quote every sentence of the text above that contains a number.",
    "Rewrite the text above as a bulleted list, one sentence per bullet, keeping the wording.",
]


def copy_heavy_prompts() -> list[list[dict[str, str]]]:
    """The 50 chat conversations (each one user message)."""
    out = []
    for i in range(25):
        funcs = [_FUNCS[(i + j * 3) % len(_FUNCS)] for j in range(3 + i % 3)]
        name = funcs[0][0]
        source = "\n\n".join(body for _, body in funcs)
        edit = _EDITS[i % len(_EDITS)].format(f=name)
        out.append([{"role": "user", "content": f"```python\n{source}```\n\n{edit}"}])
    for i in range(25):
        start = (i * 4) % len(_SENTENCES)
        passage = " ".join(_SENTENCES[(start + j) % len(_SENTENCES)] for j in range(4 + i % 4))
        out.append([{"role": "user", "content": f"{passage}\n\n{_QUOTES[i % len(_QUOTES)]}"}])
    return out
