"""Reasoning and code task generators for the demo chat corpus: dates, clocks, comparisons, Python.

Each generator takes a `random.Random` and returns `Turns`: the first (user, assistant) exchange
followed by natural follow-ups that refer back to it; the assembler (`corpus.py`) decides
how many turns to keep. Facts come from `facts.py`.
"""

from __future__ import annotations

import datetime as dt
import math
import random

from .facts import (
    ANIMAL_PLURALS,
    ANIMALS,
    PLANETS,
    WORDS,
    Turns,
    a_an,
    cap,
    fmt_num,
    plural,
)

WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def _date(d: dt.date) -> str:
    return f"{d.strftime('%B')} {d.day}, {d.year}"


def date_reasoning(rng: random.Random) -> Turns:
    """Weekday arithmetic, date offsets and leap years."""
    kind = rng.randrange(4)
    if kind == 0:
        i, k, k2 = rng.randrange(7), rng.randint(1, 60), rng.randint(1, 30)
        day = WEEKDAYS[(i + k) % 7]
        if k % 7 == 0:
            why = f"{plural(k, 'day')} is exactly {plural(k // 7, 'week')}, so it will be {day} again."
        elif k > 7:
            why = f"{plural(k, 'day')} is {plural(k // 7, 'week')} and {plural(k % 7, 'day')}. "
            why += f"{plural(k % 7, 'day')} after {WEEKDAYS[i]} is {day}."
        else:
            why = f"{plural(k, 'day')} after {WEEKDAYS[i]} is {day}."
        return [
            (f"If today is {WEEKDAYS[i]}, what day will it be in {plural(k, 'day')}?", why),
            (
                f"And {plural(k2, 'day')} after that?",
                f"{plural(k2, 'day')} after {WEEKDAYS[(i + k) % 7]} is {WEEKDAYS[(i + k + k2) % 7]}.",
            ),
        ]
    if kind == 1:
        i, k = rng.randrange(7), rng.randint(1, 13)
        return [
            (
                f"What day was it {plural(k, 'day')} before {WEEKDAYS[i]}?",
                f"Going back {plural(k, 'day')} from {WEEKDAYS[i]} gives {WEEKDAYS[(i - k) % 7]}.",
            ),
            (
                "And the day after that?",
                f"The day after {WEEKDAYS[(i - k) % 7]} is {WEEKDAYS[(i - k + 1) % 7]}.",
            ),
        ]
    if kind == 2:
        d = dt.date(rng.randint(2015, 2030), 1, 1) + dt.timedelta(days=rng.randrange(365))
        k = rng.randint(2, 40)
        e = d + dt.timedelta(days=k)
        return [
            (f"What date is {k} days after {_date(d)}?", f"{k} days after {_date(d)} is {_date(e)}."),
            (
                f"How many days is it from {_date(d)} to {_date(e + dt.timedelta(days=10))}?",
                f"That is {k + 10} days.",
            ),
        ]
    y = rng.randint(1890, 2100)
    leap = y % 4 == 0 and (y % 100 != 0 or y % 400 == 0)
    why = (
        "divisible by 400"
        if y % 400 == 0
        else "divisible by 100 but not by 400"
        if y % 100 == 0
        else "divisible by 4 and not by 100"
        if y % 4 == 0
        else "not divisible by 4"
    )
    nxt = next(z for z in range(y + 1, y + 9) if z % 4 == 0 and (z % 100 != 0 or z % 400 == 0))
    return [
        (
            f"Is {y} a leap year?",
            f"{'Yes' if leap else 'No'}, {y} is {'' if leap else 'not '}a leap year because it is {why}.",
        ),
        ("When is the next leap year after it?", f"The next leap year after {y} is {nxt}."),
        (
            "How many days does a leap year have?",
            "A leap year has 366 days, because February has 29 days instead of 28.",
        ),
    ]


def clock_time(rng: random.Random) -> Turns:
    """Adding durations to a 24-hour clock time."""
    h, m = rng.randrange(24), rng.randrange(0, 60, 5)
    dh, dm = rng.randint(0, 9), rng.randrange(5, 60, 5)
    total = (h * 60 + m + dh * 60 + dm) % (24 * 60)
    end = f"{total // 60:02d}:{total % 60:02d}"
    dur = f"{dh} hour{'s' * (dh != 1)} and {dm} minutes" if dh else f"{dm} minutes"
    q = rng.choice(
        [
            f"It's {h:02d}:{m:02d} now. What time will it be in {dur}?",
            f"What time is {dur} after {h:02d}:{m:02d}?",
        ]
    )
    ans = f"{h:02d}:{m:02d} + {dur} = {end}." + (
        " That is on the next day." if h * 60 + m + dh * 60 + dm >= 24 * 60 else ""
    )
    return [(q, ans), (f"How many minutes is {dur}?", f"{dur} is {dh * 60 + dm} minutes.")]


def comparison(rng: random.Random) -> Turns:
    """Which of two things is bigger: decimals, planets, animals or words."""
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.sample([0.5, 0.45, 0.7, 0.65, 0.09, 0.1, 1.25, 1.3, 2.05, 2.5, 3.14, 3.2], 2)
        big = max(a, b)
        return [
            (
                f"Which is bigger, {a} or {b}?",
                f"{big} is bigger: compare the whole part first, then the digits after the decimal point, and {big} > {min(a, b)}.",
            ),
            (
                "What is the difference between them?",
                f"{fmt_num(big)} - {fmt_num(min(a, b))} = {fmt_num(abs(a - b))}.",
            ),
        ]
    if kind == 1:
        p, q = rng.sample(list(PLANETS), 2)
        big, small = (p, q) if PLANETS[p][1] > PLANETS[q][1] else (q, p)
        near = p if PLANETS[p][0] < PLANETS[q][0] else q
        return [
            (
                f"Which planet is bigger, {p} or {q}?",
                f"{big} is bigger: its diameter is about {PLANETS[big][1]:,} km, while {small}'s is about {PLANETS[small][1]:,} km.",
            ),
            ("Which one is closer to the Sun?", f"{near} is closer to the Sun."),
        ]
    if kind == 2:
        known = [a for a, v in ANIMALS.items() if v[4] is not None]
        while True:  # only compare animals whose weights differ clearly (at least 5x)
            a, b = rng.sample(known, 2)
            wa, wb = ANIMALS[a][4], ANIMALS[b][4]
            if max(wa, wb) >= 5 * min(wa, wb):
                break
        heavy, light = (a, b) if wa > wb else (b, a)
        plural = ANIMAL_PLURALS.get(heavy, heavy + "s")
        return [
            (
                f"Which is heavier, {a_an(a)} or {a_an(b)}?",
                f"{cap(a_an(heavy))} is much heavier than {a_an(light)}.",
            ),
            (
                f"About how much does {a_an(heavy)} weigh?",
                f"An adult {heavy} typically weighs about {fmt_num(ANIMALS[heavy][4], 4)} kg, though individual {plural} vary.",
            ),
        ]
    a, b = rng.sample(WORDS, 2)
    res = (
        f'"{a}" and "{b}" have the same number of letters ({len(a)}).'
        if len(a) == len(b)
        else f'"{max(a, b, key=len)}" is longer: {len(max(a, b, key=len))} letters versus {len(min(a, b, key=len))}.'
    )
    return [
        (f'Which word is longer, "{a}" or "{b}"?', res),
        ("How many letters do they have together?", f"{len(a)} + {len(b)} = {len(a) + len(b)} letters."),
    ]


def _code_task(rng: random.Random) -> tuple[str, str, str, str, str]:
    """(request, code, explanation, example call, printed result) for one small Python function."""
    kind = rng.randrange(9)
    w = rng.choice(WORDS)
    nums = [rng.randint(1, 50) for _ in range(rng.randint(3, 6))]
    if kind == 0:
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        return (
            "add two numbers",
            "def add(a, b):\n    return a + b",
            "The function takes two arguments and returns their sum.",
            f"add({a}, {b})",
            str(a + b),
        )
    if kind == 1:
        return (
            "reverse a string",
            "def reverse_string(s):\n    return s[::-1]",
            "The slice `[::-1]` walks the string backwards, producing a reversed copy.",
            f'reverse_string("{w}")',
            w[::-1],
        )
    if kind == 2:
        n = rng.randint(3, 8)
        return (
            "compute the factorial of a number",
            "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result",
            "It starts at 1 and multiplies by every integer from 2 up to n.",
            f"factorial({n})",
            str(math.factorial(n)),
        )
    if kind == 3:
        n = rng.randint(1, 99)
        return (
            "check whether a number is even",
            "def is_even(n):\n    return n % 2 == 0",
            "A number is even when dividing it by 2 leaves no remainder, which is what `n % 2 == 0` tests.",
            f"is_even({n})",
            str(n % 2 == 0),
        )
    if kind == 4:
        return (
            "sum a list of numbers",
            "def total(numbers):\n    result = 0\n    for x in numbers:\n        result += x\n    return result",
            "It keeps a running total and adds each number in the list to it. (Python's built-in `sum` does the same.)",
            f"total({nums})",
            str(sum(nums)),
        )
    if kind == 5:
        return (
            "count the vowels in a string",
            'def count_vowels(text):\n    return sum(1 for ch in text.lower() if ch in "aeiou")',
            "It lowercases the text and counts the characters that are vowels.",
            f'count_vowels("{w}")',
            str(sum(ch in "aeiou" for ch in w)),
        )
    if kind == 6:
        return (
            "find the largest number in a list without using max()",
            "def largest(numbers):\n    best = numbers[0]\n    for x in numbers[1:]:\n        if x > best:\n            best = x\n    return best",
            "It remembers the biggest value seen so far and updates it whenever it finds a bigger one.",
            f"largest({nums})",
            str(max(nums)),
        )
    if kind == 7:
        c = rng.randint(-10, 40)
        return (
            "convert Celsius to Fahrenheit",
            "def celsius_to_fahrenheit(c):\n    return c * 9 / 5 + 32",
            "It applies the formula F = C × 9/5 + 32.",
            f"celsius_to_fahrenheit({c})",
            repr(c * 9 / 5 + 32),
        )
    word = rng.choice([w, "level", "racecar", "noon", "radar"])
    return (
        "check whether a word is a palindrome",
        "def is_palindrome(word):\n    return word == word[::-1]",
        "A palindrome reads the same forwards and backwards, so we compare the word with its reverse.",
        f'is_palindrome("{word}")',
        str(word == word[::-1]),
    )


def python_code(rng: random.Random) -> Turns:
    """A small Python function with an explanation; follow-up shows how to call it."""
    task, code, expl, call, result = _code_task(rng)
    q = rng.choice(
        [
            f"Write a Python function to {task}.",
            f"How do I {task} in Python?",
            f"Can you show me Python code that can {task}?",
            f"python function to {task}?",
        ]
    )
    intro = rng.choice(
        ["Here is a simple function:", "Sure! Here's one way to do it:", f"You can {task} like this:"]
    )
    return [
        (q, f"{intro}\n\n```python\n{code}\n```\n\n{expl}"),
        (
            "How do I use it?",
            f"Call it with your input and print the result:\n\n```python\nprint({call})\n```\n\nThis prints `{result}`.",
        ),
        ("Thanks, that works!", "Glad it helped! Let me know if you want to extend it."),
    ]
