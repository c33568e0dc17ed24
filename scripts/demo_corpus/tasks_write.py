"""Writing task generators for the demo chat corpus: recipes, tips, emails, summaries, stories, jokes.

Each generator takes a `random.Random` and returns `Turns`: the first (user, assistant) exchange
followed by natural follow-ups that refer back to it; the assembler (`corpus.py`) decides
how many turns to keep. Facts come from `facts.py`.
"""

from __future__ import annotations

import random
from fractions import Fraction

from .facts import (
    ADVICE,
    JOKES,
    NAMES,
    RECIPES,
    RIDDLES,
    TRAVEL,
    Turns,
    a_an,
    bullets,
    fmt_frac,
)


def _ingredients(items: list[tuple[Fraction, str, str]], scale: Fraction) -> str:
    """Ingredient lines scaled by `scale`, with units and nouns pluralized to match."""
    lines = []
    for qty, unit, item in items:
        q = qty * scale
        if not unit:
            one, many = item.split("|")
            lines.append(f"- {fmt_frac(q)} {many if q > 1 else one}")
        else:
            unit = {"pinch": "pinches"}.get(unit, unit + "s") if q > 1 else unit
            lines.append(f"- {fmt_frac(q)} {unit} {'of ' if unit.startswith('pinch') else ''}{item}")
    return "\n".join(lines)


def recipe(rng: random.Random) -> Turns:
    """A short recipe; follow-ups scale it up or down."""
    name = rng.choice(list(RECIPES))
    serves, items, steps = RECIPES[name]
    q = rng.choice(
        [
            f"How do I make {name}?",
            f"Give me a simple recipe for {name}.",
            f"Can you share {a_an(name)} recipe?",
            f"recipe for {name} please",
        ]
    )
    intro = rng.choice(
        [f"Here is a simple recipe for {name} (serves {serves}).", f"Sure! This makes {name} for {serves}."]
    )
    body = f"{intro}\n\nIngredients:\n{_ingredients(items, Fraction(1))}\n\nSteps:\n" + "\n".join(
        f"{i}. {s}" for i, s in enumerate(steps, 1)
    )
    big = (
        f"I need it for {serves * 2} people.",
        f"Just double everything:\n{_ingredients(items, Fraction(2))}",
    )
    small = (
        "Can you halve it?",
        f"Here are the amounts for half a batch:\n{_ingredients(items, Fraction(1, 2))}",
    )
    return [(q, body), rng.choice([big, small]), ("Thanks!", f"You're welcome! Enjoy your {name}.")]


def travel_tips(rng: random.Random) -> Turns:
    """City travel tips."""
    city = rng.choice(list(TRAVEL))
    tips = rng.sample(TRAVEL[city], rng.randint(3, 5))
    month = rng.choice(["March", "June", "August", "October", "December"])
    q = rng.choice(
        [
            f"I'm visiting {city} in {month}. Any tips?",
            f"What should I do in {city}?",
            f"Give me some travel tips for {city}.",
            f"first time going to {city}, what do you recommend?",
        ]
    )
    intro = rng.choice(
        [
            f"Great choice! Here are some tips for {city}:",
            f"Here are a few things to keep in mind in {city}:",
            f"{city} is wonderful. Some tips:",
        ]
    )
    outro = rng.choice(["", "\n\nHave a wonderful trip!", "\n\nEnjoy your visit!"])
    return [
        (q, f"{intro}\n\n{bullets(rng, tips)}{outro}"),
        ("Which one is the most important?", f"If you only do one thing, do this: {tips[0]}"),
        ("Thank you!", rng.choice(["You're welcome! Have a great trip.", "My pleasure. Enjoy!"])),
    ]


PACKING = {
    "beach holiday": [
        "swimsuit",
        "sunscreen",
        "sunglasses",
        "a hat",
        "a beach towel",
        "sandals",
        "a reusable water bottle",
    ],
    "ski trip": [
        "a warm waterproof jacket",
        "thermal underwear",
        "gloves",
        "a hat",
        "ski socks",
        "goggles",
        "lip balm with sunscreen",
    ],
    "camping weekend": [
        "a tent",
        "a sleeping bag",
        "a flashlight",
        "a first aid kit",
        "warm layers",
        "a rain jacket",
        "insect repellent",
    ],
    "business trip": [
        "a laptop and charger",
        "business clothes",
        "comfortable shoes",
        "a phone charger",
        "your travel documents",
        "a notebook",
    ],
}


def packing(rng: random.Random) -> Turns:
    """Packing lists for a kind of trip."""
    trip = rng.choice(list(PACKING))
    items = rng.sample(PACKING[trip], 5)
    q = rng.choice(
        [
            f"What should I pack for a {trip}?",
            f"Packing list for a {trip}?",
            f"I'm going on a {trip}. What do I need to bring?",
        ]
    )
    return [
        (q, f"For a {trip}, bring:\n\n{bullets(rng, items)}"),
        (
            "Anything else?",
            f"Also consider {PACKING[trip][-1] if PACKING[trip][-1] not in items else 'snacks for the journey'}.",
        ),
        ("Thanks!", "You're welcome. Have a good trip!"),
    ]


def email(rng: random.Random) -> Turns:
    """Short emails for everyday situations, with shorter and more formal rewrites."""
    to, me = rng.sample(NAMES, 2)
    day = rng.choice(["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"])
    kind = rng.randrange(4)
    if kind == 0:
        ask, subject = f"asking my manager {to} for a day off on {day}", f"Day off on {day}"
        body, short = (
            f"I would like to request a day off on {day} for a personal appointment. I will make sure my tasks are covered before then.",
            f"Could I take {day} off? My tasks will be covered.",
        )
    elif kind == 1:
        ask, subject = f"to {to} to move our meeting to {day}", f"Moving our meeting to {day}"
        body, short = (
            f"Something came up, and I need to move our meeting. Would {day} at the same time work for you?",
            f"Can we move our meeting to {day}?",
        )
    elif kind == 2:
        ask, subject = f"thanking {to} for the job interview", "Thank you for the interview"
        body, short = (
            "Thank you for taking the time to meet with me. I enjoyed learning more about the role and the team, and I am very interested in the position.",
            "Thank you for the interview; I am very interested in the role.",
        )
    else:
        ask, subject = f"inviting {to} to my birthday party on {day}", f"Birthday party on {day}"
        body, short = (
            f"I'm having a small birthday party on {day} evening at my place, and I would love for you to come. Let me know if you can make it!",
            f"Party at my place on {day} evening. Hope you can come!",
        )
    q = rng.choice(
        [f"Write an email {ask}.", f"Can you draft an email {ask}?", f"Help me write a short email {ask}."]
    )
    full = (
        f"Subject: {subject}\n\nHi {to},\n\n{body}\n\nBest regards,\n{me}"
        if rng.random() < 0.5
        else f"Subject: {subject}\n\nHi {to},\n\n{body}\n\nThanks,\n{me}"
    )
    if rng.random() < 0.5:
        q += f" Sign it {me}."
    return [
        (q, full),
        ("Can you make it shorter?", f"Hi {to},\n\n{short}\n\n{me}"),
        ("Now make it more formal.", f"Subject: {subject}\n\nDear {to},\n\n{body}\n\nKind regards,\n{me}"),
    ]


def summary(rng: random.Random) -> Turns:
    """Summaries of short generated paragraphs, plus a title."""
    name, city = rng.choice(NAMES), rng.choice(["Lisbon", "Oslo", "Denver", "Lyon", "Porto", "Osaka"])
    year, k, n = rng.randint(1995, 2020), rng.randint(3, 20), rng.randint(5, 40) * 10
    kind = rng.randrange(3)
    if kind == 0:
        shop, a, b = rng.choice(
            [
                ("bakery", "bread", "cakes"),
                ("bookshop", "used books", "new novels"),
                ("cafe", "coffee", "breakfast"),
            ]
        )
        text = (
            f"{name} opened a small {shop} in {city} in {year}. At first, the {shop} sold only {a}, but customers soon asked for {b}. "
            f"Today it has {k} employees and serves about {n} customers a day."
        )
        summ, title = (
            f"{name}'s {shop} in {city}, opened in {year}, grew from selling only {a} to a business with {k} employees serving about {n} customers a day.",
            f"From {a.title()} to {b.title()}: A {shop.title()} in {city}",
        )
        tiny = f"A small {shop} in {city} grew into a busy business."
    elif kind == 1:
        town, fest = (
            rng.choice(["Millbrook", "Riverton", "Oakdale", "Cedar Falls"]),
            rng.choice(["kite festival", "music festival", "food fair"]),
        )
        text = (
            f"Every summer, the town of {town} holds a {fest}. It started in {year} with just a few neighbors. "
            f"Last year more than {n} visitors came, and the money raised paid for a new playground."
        )
        summ, title = (
            f"{town}'s summer {fest}, started by a few neighbors in {year}, now draws over {n} visitors and raised money for a new playground.",
            f"{town}'s Growing {fest.title()}",
        )
        tiny = f"A small-town {fest} has become popular."
    else:
        habit, outcome = rng.choice(
            [
                ("walked every day", "slept better"),
                ("read before bed", "felt less stressed"),
                ("ate breakfast", "concentrated better"),
            ]
        )
        text = (
            f"Researchers followed {n} adults for {k} months. Those who {habit} {outcome} than those who did not. "
            "The researchers say that more studies are needed to confirm the result."
        )
        summ, title = (
            f"A {k}-month study of {n} adults found that people who {habit} {outcome}, though more research is needed.",
            "Small Habits, Better Days",
        )
        tiny = f"People who {habit} {outcome}."
    q = rng.choice(
        [
            f"Summarize this paragraph in one sentence:\n\n{text}",
            f"Can you give me a short summary of this?\n\n{text}",
            f"TL;DR please:\n\n{text}",
        ]
    )
    return [
        (q, rng.choice([summ, f"Summary: {summ}"])),
        ("Give it a title.", title),
        ("Even shorter, please.", tiny),
    ]


def joke(rng: random.Random) -> Turns:
    """Jokes with explanations on request."""
    (j, why), (j2, _) = rng.sample(JOKES, 2)
    q = rng.choice(
        ["Tell me a joke.", "Know any good jokes?", "Make me laugh.", "I need a joke for my presentation."]
    )
    return [(q, rng.choice([j, f"Here's one: {j}"])), ("I don't get it.", why), ("Tell me another one.", j2)]


def riddle(rng: random.Random) -> Turns:
    """Riddles, either asked by the user or posed by the assistant."""
    (r, a), (r2, a2) = rng.sample(RIDDLES, 2)
    if rng.random() < 0.5:
        return [
            (f"Here's a riddle: {r}", f"The answer is: {a[0].lower()}{a[1:]}"),
            (f"Nice! Another one: {r2}", a2),
        ]
    return [("Give me a riddle.", r), ("I give up. What is it?", a), ("Another one?", r2)]


def story(rng: random.Random) -> Turns:
    """A tiny story assembled from characters, places and problems, with title and moral."""
    animal = rng.choice(["fox", "rabbit", "turtle", "owl", "mouse", "bear"])
    name = rng.choice(["Pip", "Luna", "Max", "Ruby", "Otto", "Mila"])
    place = rng.choice(["in a quiet forest", "in a busy harbor", "on a snowy mountain", "on a small farm"])
    goal, problem, fix, moral = rng.choice(
        [
            (
                "find the biggest strawberry",
                "a fence blocked the way",
                "asked a friendly hedgehog to show a hidden gap",
                "asking for help is a strength",
            ),
            (
                "learn to swim",
                "the water felt cold and scary",
                "practiced a little every day",
                "small steps add up",
            ),
            (
                "win the village race",
                "{name} tripped near the finish line",
                "got up and kept going",
                "it pays to keep going, even after a fall",
            ),
            (
                "build a warm home before winter",
                "the first home fell down in the wind",
                "tried again with stronger sticks",
                "mistakes help us learn",
            ),
        ]
    )
    problem = problem.format(name=name)
    short = (
        f"Once upon a time, {place}, there lived a little {animal} named {name}. {name} wanted to {goal}. "
        f"But {problem}. {name} {fix}, and in the end {name} succeeded. {name} smiled, proud of the day."
    )
    friend, kin = (
        rng.choice(["Bo", "Tilly", "Fern", "Gus"]),
        rng.choice(["grandmother", "grandfather", "teacher"]),
    )
    saying = rng.choice(
        [
            "Every big journey starts with a small step.",
            "Tomorrow is a new chance.",
            "Brave hearts try again.",
        ]
    )
    long = (
        f"Once upon a time, {place}, there lived a little {animal} named {name}. "
        f"{name} was curious and kind, and more than anything, {name} wanted to {goal}.\n\n"
        f"One morning, {name} set off with a good friend called {friend}. But {problem}. "
        f"{name} felt sad and almost gave up.\n\n"
        f'Then {name} remembered what {name}\'s {kin} always said: "{saying}" So {name} {fix}. '
        f"In the end, {name} succeeded, and that evening {name} and {friend} laughed together under the stars."
    )
    text = long if rng.random() < 0.6 else short
    q = rng.choice(
        [
            f"Write a short story about {a_an(animal)}.",
            f"Tell me a bedtime story about {a_an(animal)} named {name}.",
            f"Can you write a tiny story set {place}?",
        ]
    )
    third = (
        ("Make it shorter.", short) if text is long else ("What is the moral?", f"The moral is that {moral}.")
    )
    return [(q, text), ("Give it a title.", f'"{name} the {animal.title()}"'), third]


def advice(rng: random.Random) -> Turns:
    """Practical tips on everyday topics."""
    topic = rng.choice(list(ADVICE))
    tips = rng.sample(ADVICE[topic], rng.randint(3, 5))
    q = rng.choice(
        [
            f"How can I {topic}?",
            f"Any tips to {topic}?",
            f"I want to {topic}. Where should I start?",
            f"give me advice to {topic}",
        ]
    )
    intro = rng.choice(["Here are some tips:", f"Good goal! To {topic}:", "A few things that help:"])
    return [
        (q, f"{intro}\n\n{bullets(rng, tips)}"),
        (
            "Which tip should I start with?",
            f"Start with this one: {tips[0]} It is simple and makes a real difference.",
        ),
        ("Thanks, I'll try that.", "Good luck! Small changes add up over time."),
    ]
