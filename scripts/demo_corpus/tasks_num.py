"""Arithmetic and number task generators for the demo chat corpus.

Each generator takes a `random.Random` and returns `Turns`: the first (user, assistant) exchange
followed by natural follow-ups that refer back to it; the assembler (`corpus.py`) decides
how many turns to keep. Facts come from `facts.py`.
Every answer is computed, never guessed, so the demo target learns consistent patterns.
"""

from __future__ import annotations

import random

from .facts import (
    NAMES,
    WORDS,
    Turns,
    fmt_num,
    join_list,
    money,
)

OPS = {
    "+": ("plus", lambda a, b: a + b),
    "-": ("minus", lambda a, b: a - b),
    "×": ("times", lambda a, b: a * b),
    "÷": ("divided by", lambda a, b: a // b),
}


def _operands(rng: random.Random, op: str) -> tuple[int, int]:
    """Operands that keep results whole and friendly (exact division, non-negative subtraction)."""
    if op == "+":
        return rng.randint(2, 999), rng.randint(2, 999)
    if op == "-":
        a = rng.randint(10, 999)
        return a, rng.randint(1, a)
    if op == "×":
        return rng.randint(2, 99), rng.randint(2, 30)
    b = rng.randint(2, 12)
    return b * rng.randint(2, 99), b


def arithmetic(rng: random.Random) -> Turns:
    """Plain arithmetic, sometimes with the multiplication worked out."""
    op = rng.choice(list(OPS))
    a, b = _operands(rng, op)
    word, fn = OPS[op]
    r = fn(a, b)
    shown = {"×": rng.choice(["*", "×", "x"]), "÷": rng.choice(["/", "÷"])}.get(op, op)
    q = rng.choice(
        [
            f"What is {a} {shown} {b}?",
            f"Calculate {a} {shown} {b}.",
            f"How much is {a} {word} {b}?",
            f"{a} {shown} {b} = ?",
            f"Can you work out {a} {word} {b} for me?",
            f"what's {a}{shown}{b}",
        ]
    )
    if op == "×" and b >= 10 and rng.random() < 0.5:
        tens, ones = b - b % 10, b % 10
        ans = f"Let's split it up: {a} × {b} = {a} × {tens} + {a} × {ones} = {a * tens} + {a * ones} = {r}."
    else:
        ans = rng.choice(
            [
                f"{a} {op} {b} = {r}",
                f"{a} {word} {b} is {r}.",
                f"The answer is {r}.",
                f"Sure! {a} {op} {b} = {r}.",
            ]
        )
    k = rng.randint(2, 5)
    parity = "even" if r % 2 == 0 else "odd"
    return [
        (q, ans),
        (f"And if you multiply that by {k}?", f"{r} × {k} = {r * k}."),
        ("Is that number even or odd?", f"{r * k} is {'even' if r * k % 2 == 0 else 'odd'}.")
        if rng.random() < 0.5
        else ("Is the first result even or odd?", f"{r} is {parity}."),
    ]


def word_problem(rng: random.Random) -> Turns:
    """Short story problems with a worked solution."""
    name, other = rng.sample(NAMES, 2)
    kind = rng.randrange(5)
    if kind == 0:
        n, p = rng.randint(2, 12), rng.randint(1, 20)
        item = rng.choice(["notebook", "apple", "ticket", "pen", "muffin", "plant"])
        m = rng.randint(1, 5)
        return [
            (
                f"{name} buys {n} {item}s at ${p} each. How much does {name} spend in total?",
                f"Multiply the number of {item}s by the price: {n} × ${p} = ${n * p}. {name} spends ${n * p}.",
            ),
            (
                f"What if {name} buys {m} more?",
                f"Then it is {n + m} {item}s: {n + m} × ${p} = ${(n + m) * p}.",
            ),
        ]
    if kind == 1:
        k = rng.randint(2, 8)
        total = rng.randint(k, 60)
        q, r = divmod(total, k)
        left = f" and {r} {'is' if r == 1 else 'are'} left over" if r else " and none are left over"
        return [
            (
                f"{name} has {total} cookies and shares them equally among {k} friends. How many does each friend get?",
                f"{total} ÷ {k} = {q}{f' remainder {r}' if r else ''}. Each friend gets {q} cookie{'s' * (q != 1)}{left}.",
            ),
            (
                f"What if {name} also keeps a share, so there are {k + 1} people?",
                f"{total} ÷ {k + 1} = {total // (k + 1)} remainder {total % (k + 1)}, so everyone gets {total // (k + 1)}."
                if total % (k + 1)
                else f"{total} ÷ {k + 1} = {total // (k + 1)}, so everyone gets {total // (k + 1)}.",
            ),
        ]
    if kind == 2:
        v, t = rng.choice([40, 50, 60, 75, 80, 90, 120]), rng.randint(2, 6)
        return [
            (
                f"A train travels at {v} km/h for {t} hours. How far does it go?",
                f"Distance = speed × time = {v} km/h × {t} h = {v * t} km.",
            ),
            (f"How long would {v * t * 2} km take at the same speed?", f"{v * t * 2} ÷ {v} = {t * 2} hours."),
        ]
    if kind == 3:
        a, d, y = rng.randint(5, 40), rng.randint(1, 15), rng.randint(1, 10)
        return [
            (
                f"{name} is {a} years old. {other} is {d} year{'s' * (d != 1)} older. How old will {other} be in {y} year{'s' * (y != 1)}?",
                f"{other} is {a} + {d} = {a + d} now, so in {y} year{'s' * (y != 1)} {other} will be {a + d} + {y} = {a + d + y}.",
            ),
            (f"And how old will {name} be then?", f"{name} will be {a} + {y} = {a + y}."),
        ]
    cost = rng.randint(105, 4495)
    bill = 2000 if cost < 1500 else 5000  # keeps the change above the $2 tip
    return [
        (
            f"{name} pays for a {money(cost)} lunch with a {money(bill)} bill. How much change should {name} get?",
            f"{money(bill)} - {money(cost)} = {money(bill - cost)}. {name} should get {money(bill - cost)} back.",
        ),
        (
            f"What if {name} also leaves a {money(200)} tip from the change?",
            f"{money(bill - cost)} - $2.00 = {money(bill - cost - 200)} left.",
        ),
    ]


# (from unit, to unit, function, low, high, rule, exact?): "about" is only said for rounded results.
CONVERSIONS = [
    ("kilometers", "miles", lambda x: x * 0.621371, 2, 500, "multiply by 0.621371", False),
    ("miles", "kilometers", lambda x: x * 1.609344, 2, 300, "multiply by 1.609344", False),
    ("kilograms", "pounds", lambda x: x * 2.20462, 2, 150, "multiply by 2.20462", False),
    ("pounds", "kilograms", lambda x: x * 0.453592, 2, 300, "multiply by 0.453592", False),
    ("meters", "feet", lambda x: x * 3.28084, 2, 200, "multiply by 3.28084", False),
    ("inches", "centimeters", lambda x: x * 2.54, 2, 100, "multiply by 2.54", True),
    (
        "degrees Celsius",
        "degrees Fahrenheit",
        lambda x: x * 9 / 5 + 32,
        -20,
        100,
        "multiply by 9/5 and add 32",
        True,
    ),
    (
        "degrees Fahrenheit",
        "degrees Celsius",
        lambda x: (x - 32) * 5 / 9,
        0,
        212,
        "subtract 32 and multiply by 5/9",
        False,
    ),
    ("liters", "US gallons", lambda x: x * 0.264172, 2, 100, "multiply by 0.264172", False),
    ("hours", "minutes", lambda x: x * 60, 2, 48, "multiply by 60", True),
    ("minutes", "seconds", lambda x: x * 60, 2, 120, "multiply by 60", True),
    ("days", "hours", lambda x: x * 24, 2, 30, "multiply by 24", True),
    ("meters", "centimeters", lambda x: x * 100, 2, 50, "multiply by 100", True),
    ("grams", "kilograms", lambda x: x / 1000, 50, 5000, "divide by 1000", True),
]


def unit_conversion(rng: random.Random) -> Turns:
    """Unit conversions with the rule stated."""
    src, dst, fn, lo, hi, rule, exact = rng.choice(CONVERSIONS)
    about = "" if exact else "about "
    x, x2 = rng.randint(lo, hi), rng.randint(lo, hi)
    q = rng.choice(
        [
            f"Convert {x} {src} to {dst}.",
            f"How many {dst} is {x} {src}?",
            f"What is {x} {src} in {dst}?",
            f"{x} {src} to {dst}?",
            f"I need {x} {src} in {dst}, please.",
        ]
    )
    ans = rng.choice(
        [
            f"{x} {src} is {about}{fmt_num(fn(x), 3)} {dst}.",
            f"To convert {src} to {dst}, {rule}: {x} → {fmt_num(fn(x), 3)} {dst}.",
            f"That's {about}{fmt_num(fn(x), 3)} {dst}.",
        ]
    )
    return [
        (q, ans),
        (f"What about {x2} {src}?", f"{x2} {src} is {about}{fmt_num(fn(x2), 3)} {dst}."),
        ("How did you calculate it?", f"To go from {src} to {dst}, {rule}."),
    ]


def sorting(rng: random.Random) -> Turns:
    """Sort numbers or words; follow-ups reverse or sum the same list."""
    if rng.random() < 0.6:
        nums = rng.sample(range(1, 200), rng.randint(4, 9))
        shown = ", ".join(map(str, nums))
        asc = ", ".join(map(str, sorted(nums)))
        q = rng.choice(
            [
                f"Sort these numbers from smallest to largest: {shown}",
                f"Put in ascending order: {shown}",
                f"Can you order these numbers for me? {shown}",
            ]
        )
        return [
            (q, rng.choice([asc, f"Here they are in ascending order: {asc}"])),
            ("Now from largest to smallest.", ", ".join(map(str, sorted(nums, reverse=True)))),
            ("What is their sum?", f"{' + '.join(map(str, sorted(nums)))} = {sum(nums)}."),
        ]
    words = rng.sample(WORDS, rng.randint(4, 8))
    q = rng.choice(
        [f"Sort these words alphabetically: {', '.join(words)}", f"Alphabetize this list: {', '.join(words)}"]
    )
    return [
        (
            q,
            "\n".join(f"{i}. {w}" for i, w in enumerate(sorted(words), 1))
            if rng.random() < 0.5
            else ", ".join(sorted(words)),
        ),
        ("And in reverse order?", ", ".join(sorted(words, reverse=True))),
        (
            "Which word is the longest?",
            f'"{max(words, key=len)}" has the most letters ({len(max(words, key=len))}).',
        ),
    ]


def number_facts(rng: random.Random) -> Turns:
    """Prime / even / factors questions about one number."""
    n = rng.randint(2, 200)
    factors = [d for d in range(1, n + 1) if n % d == 0]
    if len(factors) == 2:
        prime = f"Yes, {n} is a prime number: its only divisors are 1 and {n}."
    else:
        d = factors[1]
        prime = f"No, {n} is not prime, because it is divisible by {d} ({n} = {d} × {n // d})."
    even = f"{n} is {'even' if n % 2 == 0 else 'odd'}, because {n} ÷ 2 {'has no remainder' if n % 2 == 0 else 'leaves a remainder of 1'}."
    first = rng.choice(
        [(f"Is {n} a prime number?", prime), (f"Is {n} prime?", prime), (f"Is {n} even or odd?", even)]
    )
    return [
        first,
        ("What are its factors?", f"The factors of {n} are {join_list([str(f) for f in factors])}."),
        ("How many factors is that?", f"{n} has {len(factors)} factors."),
    ]


def percentage(rng: random.Random) -> Turns:
    """Percent of a number, discounts and tips, computed in integer cents."""
    p = rng.choice([5, 10, 15, 20, 25, 30, 40, 50, 75])
    if rng.random() < 0.4:
        x = rng.randint(1, 40) * 20
        return [
            (
                rng.choice([f"What is {p}% of {x}?", f"Calculate {p} percent of {x}."]),
                f"{p}% of {x} = {x} × {p} / 100 = {fmt_num(x * p / 100)}.",
            ),
            (
                f"And {p * 2 if p <= 50 else p // 5}%?",
                f"{fmt_num(x * (p * 2 if p <= 50 else p // 5) / 100)}.",
            ),
        ]
    price = rng.randint(5, 200) * 100
    if rng.random() < 0.5:
        off = price * p // 100
        item = rng.choice(["jacket", "lamp", "pair of shoes", "backpack", "board game"])
        return [
            (
                f"A {item} costs {money(price)} and is {p}% off. What is the sale price?",
                f"The discount is {p}% of {money(price)} = {money(off)}, so the sale price is {money(price)} - {money(off)} = {money(price - off)}.",
            ),
            ("How much do I save?", f"You save {money(off)}."),
        ]
    tip = price * p // 100
    return [
        (
            f"What's a {p}% tip on a {money(price)} bill?",
            f"A {p}% tip on {money(price)} is {money(tip)}, for a total of {money(price + tip)}.",
        ),
        (
            "Split the total between 2 people?",
            f"{money(price + tip)} ÷ 2 = {money((price + tip) // 2)} each"
            + ("." if (price + tip) % 2 == 0 else " (plus one cent left over)."),
        ),
    ]


def statistics(rng: random.Random) -> Turns:
    """Mean / median / range of a small list."""
    nums = [rng.randint(1, 100) for _ in range(rng.choice([3, 5, 7]))]
    shown = ", ".join(map(str, nums))
    mean = sum(nums) / len(nums)
    median = sorted(nums)[len(nums) // 2]
    first = rng.choice(
        [
            (
                f"What is the average of {shown}?",
                f"Add them up: {sum(nums)}. Divide by {len(nums)}: {sum(nums)} ÷ {len(nums)} = {fmt_num(mean)}.",
            ),
            (
                f"Find the median of {shown}.",
                f"Sorted: {', '.join(map(str, sorted(nums)))}. The middle value is {median}.",
            ),
            (
                f"What's the range of these numbers: {shown}?",
                f"The range is the largest minus the smallest: {max(nums)} - {min(nums)} = {max(nums) - min(nums)}.",
            ),
        ]
    )
    return [
        first,
        (
            "And the mean?" if "average" not in first[0] else "And the median?",
            f"The mean is {fmt_num(mean)}." if "average" not in first[0] else f"The median is {median}.",
        ),
        ("Which number is the largest?", f"The largest is {max(nums)}."),
    ]
