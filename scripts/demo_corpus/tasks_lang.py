"""Knowledge and language task generators for the demo chat corpus.

Each generator takes a `random.Random` and returns `Turns`: the first (user, assistant) exchange
followed by natural follow-ups that refer back to it; the assembler (`corpus.py`) decides
how many turns to keep. Facts come from `facts.py`.
"""

from __future__ import annotations

import random

from .facts import (
    ANIMAL_PLURALS,
    ANIMALS,
    CATEGORIES,
    COUNTRIES,
    DEFINITIONS,
    LANGUAGES,
    NAMES,
    PLANETS,
    SYNONYMS,
    TRANSLATIONS,
    WORDS,
    Turns,
    a_an,
    bullets,
    cap,
    join_list,
)

ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth"]


def capital(rng: random.Random) -> Turns:
    """Capital cities, with continent and language follow-ups."""
    country = rng.choice(list(COUNTRIES))
    city, continent, lang = COUNTRIES[country]
    if rng.random() < 0.25:
        first = (f"{city} is the capital of which country?", f"{city} is the capital of {country}.")
    else:
        q = rng.choice(
            [
                f"What is the capital of {country}?",
                f"capital of {country}?",
                f"Which city is the capital of {country}?",
                f"Do you know the capital city of {country}?",
            ]
        )
        first = (
            q,
            rng.choice(
                [
                    f"The capital of {country} is {city.rstrip('.')}.",
                    f"{city.rstrip('.')}.",
                    f"{city} is the capital of {country}. It is in {continent}.",
                ]
            ),
        )
    verb = "languages are" if " and " in lang else "language is"
    return [
        first,
        ("What language do they speak there?", f"In {country}, the main {verb} {lang}."),
        ("Which continent is it on?", f"{cap(country)} is in {continent}."),
    ]


def definition(rng: random.Random) -> Turns:
    """Definitions of common words, with an example sentence on request."""
    word = rng.choice(list(DEFINITIONS))
    meaning, example = DEFINITIONS[word]
    q = rng.choice(
        [
            f'What does "{word}" mean?',
            f"Define {word}.",
            f"What is the meaning of the word {word}?",
            f"Can you explain the word '{word}'?",
        ]
    )
    ans = rng.choice(
        [
            f'"{cap(word)}" means {meaning}.',
            f"{cap(word)}: {meaning}.",
            f'The word "{word}" means {meaning}. For example: "{example}"',
        ]
    )
    return [
        (q, ans),
        ("Can you use it in a sentence?", example),
        ("How do you spell it?", "-".join(word.upper())),
    ]


def _letter_game(kind: int, letter: str, x: str) -> tuple[str, str]:
    """(question, answer) of letter game `kind` played on word `x`."""
    if kind == 0:
        return f"Reverse the word {x}.", f'"{x}" reversed is "{x[::-1]}".'
    if kind == 1:
        return f"How many letters are in the word {x}?", f'"{x}" has {len(x)} letters: {", ".join(x)}.'
    if kind == 2:
        return f"Spell {x} letter by letter.", "-".join(x.upper())
    if kind == 3:
        return f"Write {x} in capital letters.", x.upper()
    n = x.count(letter)
    return (
        f'How many times does the letter "{letter}" appear in "{x}"?',
        f'The letter "{letter}" appears {n} time{"s" * (n != 1)} in "{x}".',
    )


def spelling(rng: random.Random) -> Turns:
    """Letter games on a single word; the follow-up repeats the game on another word."""
    w, w2 = rng.sample(WORDS, 2)
    kind = rng.randrange(5)
    letter = rng.choice("aeiou") if kind == 4 else ""
    (q, a), (_, a2) = _letter_game(kind, letter, w), _letter_game(kind, letter, w2)
    return [
        (q, a),
        (f"Now do the same for {w2}.", a2),
        ("What is the first letter of that word?", f'The first letter of "{w2}" is "{w2[0]}".'),
    ]


SENTENCES = [
    "The quick brown fox jumps over the lazy dog",
    "I like to read books on rainy days",
    "My sister plays the piano every evening",
    "We visited the museum last Saturday",
    "Cats sleep for many hours each day",
    "The train to the city leaves at eight",
    "Learning a new language takes time and practice",
    "He planted tomatoes and beans in the garden",
]


def word_count(rng: random.Random) -> Turns:
    """Counting and inspecting the words of a sentence."""
    s = rng.choice(SENTENCES)
    words = s.split()
    longest = max(words, key=len)
    return [
        (
            rng.choice([f'How many words are in this sentence: "{s}."', f'Count the words: "{s}."']),
            f"There are {len(words)} words: {', '.join(words)}.",
        ),
        ("Which word is the longest?", f'The longest word is "{longest}", with {len(longest)} letters.'),
        ("What is the last word?", f'The last word is "{words[-1]}".'),
    ]


def translation(rng: random.Random) -> Turns:
    """Phrase translation from a small dictionary; follow-ups ask other languages."""
    phrase = rng.choice(list(TRANSLATIONS))
    order = rng.sample(range(len(LANGUAGES)), 3)
    out = [(LANGUAGES[i], TRANSLATIONS[phrase][i]) for i in order]
    lang, word = out[0]
    q = rng.choice(
        [
            f'How do you say "{phrase}" in {lang}?',
            f'Translate "{phrase}" into {lang}.',
            f'What is "{phrase}" in {lang}?',
        ]
    )
    first = (q, rng.choice([f'In {lang}, "{phrase}" is "{word}".', f'"{word}"', f'You say "{word}".']))
    return [first] + [(f"And in {lg}?", f'In {lg}, it is "{t}".') for lg, t in out[1:]]


def synonym(rng: random.Random) -> Turns:
    """Synonyms and antonyms."""
    word = rng.choice(list(SYNONYMS))
    syns, ant = SYNONYMS[word]
    syn_q = rng.choice(
        [f"What's a synonym for {word}?", f'Give me some synonyms of "{word}".', f"Another word for {word}?"]
    )
    syn_a = rng.choice(
        [
            f'Some synonyms for "{word}" are {join_list(list(syns))}.',
            f"You could say {join_list(list(syns[:2]), 'or')}.",
        ]
    )
    ant_q, ant_a = (
        rng.choice([f"What is the opposite of {word}?", f"Antonym of {word}?"]),
        f'The opposite of "{word}" is "{ant}".',
    )
    if rng.random() < 0.6:
        return [(syn_q, syn_a), ("And the opposite?", ant_a), ("Thanks!", "You're welcome!")]
    return [(ant_q, ant_a), (f'And a synonym for "{word}"?', f'A synonym is "{syns[0]}".')]


def animal(rng: random.Random) -> Turns:
    """Animal trivia: class, diet, habitat and a fun fact."""
    name = rng.choice(list(ANIMALS))
    kind, diet, habitat, fact, _ = ANIMALS[name]
    plural = ANIMAL_PLURALS.get(name, name + "s")
    mammal = f"Yes, {a_an(name)} is a mammal." if kind == "mammal" else f"No, {a_an(name)} is {a_an(kind)}."
    firsts = [
        (f"Tell me something interesting about {plural}.", fact),
        (f"What kind of animal is {a_an(name)}?", f"{cap(a_an(name))} is {a_an(kind)}."),
        (f"What do {plural} eat?", f"{cap(plural)} eat {diet}."),
        (f"Where do {plural} live?", f"{cap(plural)} live in {habitat}."),
    ]
    follows = [
        ("Tell me a fun fact about them.", fact),
        ("Is it a mammal?", mammal),
        ("What do they eat?", f"They eat {diet}."),
        ("Where do they live?", f"They live in {habitat}."),
    ]
    order = rng.sample(range(4), 3)
    return [firsts[order[0]]] + [follows[i] for i in order[1:]]


def planet(rng: random.Random) -> Turns:
    """Solar-system facts."""
    name = rng.choice(list(PLANETS))
    order, diam, year, fact = PLANETS[name]
    nxt = next((p for p, v in PLANETS.items() if v[0] == order + 1), None)
    first = rng.choice(
        [
            (f"Tell me about {name}.", f"{name} is the {ORDINALS[order - 1]} planet from the Sun. {fact}"),
            (f"How big is {name}?", f"{name} has a diameter of about {diam:,} km."),
            (
                f"How long is a year on {name}?",
                f"One orbit of {name} around the Sun takes about {year:,} Earth days.",
            ),
            (
                f"Which planet is {ORDINALS[order - 1]} from the Sun?",
                f"{name} is the {ORDINALS[order - 1]} planet from the Sun.",
            ),
        ]
    )
    bigger = "Yes" if diam > PLANETS["Earth"][1] else "No"
    turns = [
        first,
        (
            "Is it bigger than Earth?",
            f"{bigger}. {name}'s diameter is about {diam:,} km, and Earth's is about 12,742 km."
            if name != "Earth"
            else "That is Earth itself!",
        ),
    ]
    if nxt:
        turns.append(("What about the next planet?", f"The next planet is {nxt}. {PLANETS[nxt][3]}"))
    return turns


SV = [
    ("go", "goes", "to school every day"),
    ("play", "plays", "soccer on Saturdays"),
    ("watch", "watches", "TV in the evening"),
    ("like", "likes", "chocolate ice cream"),
    ("have", "has", "two cats"),
    ("study", "studies", "French at night"),
    ("do", "does", "the dishes after dinner"),
]


PAST = [
    ("go", "went", "to the park"),
    ("eat", "ate", "pizza for dinner"),
    ("see", "saw", "a great movie"),
    ("buy", "bought", "a new bike"),
    ("write", "wrote", "a letter to my aunt"),
]


NOUNS_AN = ["apple", "orange", "egg", "umbrella", "hour", "elephant", "idea"]


def grammar(rng: random.Random) -> Turns:
    """Fix one grammar mistake and explain the rule."""
    kind = rng.randrange(3)
    if kind == 0:
        base, third, rest = rng.choice(SV)
        subj = rng.choice(["She", "He", "My brother", "The teacher", rng.choice(NAMES)])
        wrong, right = f"{subj} {base} {rest}.", f"{subj} {third} {rest}."
        why, rule = (
            f'With a singular subject like "{subj}", the verb needs the -s form: "{third}".',
            "In the present simple, he, she, it and singular nouns take a verb ending in -s or -es.",
        )
    elif kind == 1:
        base, past, rest = rng.choice(PAST)
        wrong, right = f"Yesterday I {base} {rest}.", f"Yesterday I {past} {rest}."
        why, rule = (
            f'"Yesterday" is in the past, so use the past tense "{past}" instead of "{base}".',
            f'"{cap(base)}" is irregular: its past tense is "{past}".',
        )
    else:
        noun = rng.choice(NOUNS_AN)
        wrong, right = (
            f"I waited for a {noun}." if noun == "hour" else f"I have a {noun}.",
            f"I waited for an {noun}." if noun == "hour" else f"I have an {noun}.",
        )
        why, rule = (
            f'Use "an" before a vowel sound, so it is "an {noun}".',
            'Use "a" before consonant sounds and "an" before vowel sounds, for example "a dog" but "an hour".',
        )
    q = rng.choice(
        [
            f"Fix the grammar: {wrong}",
            f'Is this sentence correct? "{wrong}"',
            f"Please correct this sentence: {wrong}",
        ]
    )
    ans = rng.choice([f'Corrected: "{right}"\n\n{why}', f'It should be: "{right}" {why}', f"{right}"])
    return [(q, ans), ("Can you explain the rule?", rule), ("Thanks!", "You're welcome! Happy writing.")]


def list_items(rng: random.Random) -> Turns:
    """Name a few members of a category; follow-ups sort or extend the list."""
    cat = rng.choice(list(CATEGORIES))
    k = rng.randint(3, 6)
    items = rng.sample(CATEGORIES[cat], k + 1)
    shown = items[:k]
    q = rng.choice([f"Name {k} {cat}.", f"Can you list {k} {cat}?", f"Give me {k} examples of {cat}."])
    ans = rng.choice([bullets(rng, shown), f"Sure: {join_list(shown)}."])
    return [
        (q, ans),
        ("Now sort them alphabetically.", ", ".join(sorted(shown))),
        ("One more?", f"Another one is {items[k]}."),
    ]


def small_talk(rng: random.Random) -> Turns:
    """Greetings and questions about the assistant; the follow-up asks for a fun fact."""
    greet = rng.choice(
        [
            ("Hi!", "Hello! How can I help you today?"),
            ("Hello there", "Hi! What can I do for you?"),
            ("Good morning!", "Good morning! What would you like to do today?"),
            ("How are you today?", "I'm doing well, thanks for asking! How can I help?"),
            (
                "What can you help me with?",
                "I can answer questions, do math, convert units, explain words, write short emails and stories, share recipes and travel tips, and more.",
            ),
        ]
    )
    name, planet_name = rng.choice(list(ANIMALS)), rng.choice(list(PLANETS))
    return [
        greet,
        ("Tell me a fun fact.", ANIMALS[name][3]),
        ("Cool! Another one?", f"Here's one about {planet_name}: {PLANETS[planet_name][3]}"),
    ]
