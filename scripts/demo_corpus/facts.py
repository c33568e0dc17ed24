"""Small built-in knowledge tables for the demo chat corpus (see the tasks_*.py modules).

Kept as plain data so the task generators stay short; every fact here is meant to be correct,
because the demo target LM learns whatever we put in.
"""

from __future__ import annotations

import random
from fractions import Fraction

Turns = list[tuple[str, str]]  # (user, assistant) exchanges: the first one, then its follow-ups

# One entry per line reads better than the formatter's exploded tuples for data tables.
# fmt: off
# country -> (capital, continent, main language(s))
COUNTRIES: dict[str, tuple[str, str, str]] = {
    "France": ("Paris", "Europe", "French"),
    "Germany": ("Berlin", "Europe", "German"),
    "Italy": ("Rome", "Europe", "Italian"),
    "Spain": ("Madrid", "Europe", "Spanish"),
    "Portugal": ("Lisbon", "Europe", "Portuguese"),
    "the Netherlands": ("Amsterdam", "Europe", "Dutch"),
    "Austria": ("Vienna", "Europe", "German"),
    "Sweden": ("Stockholm", "Europe", "Swedish"),
    "Norway": ("Oslo", "Europe", "Norwegian"),
    "Denmark": ("Copenhagen", "Europe", "Danish"),
    "Finland": ("Helsinki", "Europe", "Finnish and Swedish"),
    "Poland": ("Warsaw", "Europe", "Polish"),
    "Greece": ("Athens", "Europe", "Greek"),
    "Ireland": ("Dublin", "Europe", "English and Irish"),
    "Hungary": ("Budapest", "Europe", "Hungarian"),
    "the Czech Republic": ("Prague", "Europe", "Czech"),
    "Japan": ("Tokyo", "Asia", "Japanese"),
    "China": ("Beijing", "Asia", "Mandarin Chinese"),
    "India": ("New Delhi", "Asia", "Hindi and English"),
    "South Korea": ("Seoul", "Asia", "Korean"),
    "Thailand": ("Bangkok", "Asia", "Thai"),
    "Vietnam": ("Hanoi", "Asia", "Vietnamese"),
    "Egypt": ("Cairo", "Africa", "Arabic"),
    "Kenya": ("Nairobi", "Africa", "Swahili and English"),
    "Nigeria": ("Abuja", "Africa", "English"),
    "Ghana": ("Accra", "Africa", "English"),
    "Ethiopia": ("Addis Ababa", "Africa", "Amharic"),
    "Canada": ("Ottawa", "North America", "English and French"),
    "the United States": ("Washington, D.C.", "North America", "English"),
    "Mexico": ("Mexico City", "North America", "Spanish"),
    "Cuba": ("Havana", "North America", "Spanish"),
    "Brazil": ("Brasilia", "South America", "Portuguese"),
    "Argentina": ("Buenos Aires", "South America", "Spanish"),
    "Chile": ("Santiago", "South America", "Spanish"),
    "Peru": ("Lima", "South America", "Spanish"),
    "Colombia": ("Bogota", "South America", "Spanish"),
    "Australia": ("Canberra", "Oceania", "English"),
    "New Zealand": ("Wellington", "Oceania", "English and Maori"),
}

# word -> (definition, example sentence)
DEFINITIONS: dict[str, tuple[str, str]] = {
    "umbrella": ("a folding frame covered with cloth that protects you from rain or sun", "She opened her umbrella when it started to rain."),
    "library": ("a place where books and other materials are kept for people to read or borrow", "I borrowed two novels from the library."),
    "bridge": ("a structure built over a river, road or valley so people can cross it", "We walked across the old stone bridge."),
    "garden": ("a piece of land where flowers, vegetables or other plants are grown", "My grandmother grows tomatoes in her garden."),
    "calendar": ("a chart that shows the days, weeks and months of a year", "I marked her birthday on the calendar."),
    "recipe": ("a set of instructions for preparing a particular dish", "This recipe for soup needs only five ingredients."),
    "planet": ("a large object in space that orbits a star", "Mars is the fourth planet from the Sun."),
    "habit": ("something you do regularly, often without thinking about it", "Reading before bed is a good habit."),
    "journey": ("the act of traveling from one place to another", "The journey from the city to the coast took three hours."),
    "volcano": ("a mountain with an opening through which lava, ash and gas can erupt", "The volcano erupted for the first time in fifty years."),
    "island": ("a piece of land completely surrounded by water", "They spent their holiday on a small island."),
    "curious": ("eager to learn or know something", "The curious child asked a hundred questions."),
    "honest": ("truthful and not willing to lie or cheat", "He gave an honest answer."),
    "generous": ("willing to give more money, time or help than is expected", "It was generous of you to share your lunch."),
    "ancient": ("belonging to the very distant past", "We visited the ruins of an ancient city."),
    "fragile": ("easily broken or damaged", "Be careful with that box; the glasses inside are fragile."),
    "celebrate": ("to do something enjoyable for a special occasion", "We celebrate her birthday every June."),
    "borrow": ("to take something from someone with the promise to give it back", "Can I borrow your pen for a minute?"),
    "explore": ("to travel through a place to learn about it", "They explored the forest behind the village."),
    "predict": ("to say what you think will happen in the future", "It is hard to predict the weather a month ahead."),
    "patient": ("able to wait calmly without getting annoyed", "The teacher was patient with the new students."),
    "thermometer": ("an instrument that measures temperature", "The thermometer showed twenty degrees."),
    "harvest": ("the time when crops are gathered, or the crops themselves", "The apple harvest was excellent this year."),
    "orchestra": ("a large group of musicians who play instruments together", "The orchestra played a symphony by Mozart."),
    "telescope": ("an instrument that makes distant objects look closer", "She looked at the Moon through a telescope."),
    "budget": ("a plan for how much money you will spend", "We set a budget for our holiday."),
    "deadline": ("the latest time by which something must be done", "The deadline for the report is Friday."),
    "neighbor": ("a person who lives near you", "Our neighbor helped us carry the sofa."),
    "puzzle": ("a game or problem that tests your skill or thinking", "He finished the crossword puzzle in ten minutes."),
    "gravity": ("the force that pulls objects toward each other, such as toward the Earth", "Gravity makes an apple fall from a tree."),
}

# word -> (synonyms, antonym)
SYNONYMS: dict[str, tuple[tuple[str, ...], str]] = {
    "happy": (("glad", "cheerful", "joyful"), "sad"),
    "big": (("large", "huge", "enormous"), "small"),
    "fast": (("quick", "rapid", "swift"), "slow"),
    "smart": (("clever", "bright", "intelligent"), "foolish"),
    "begin": (("start", "commence", "launch"), "finish"),
    "difficult": (("hard", "tough", "challenging"), "easy"),
    "angry": (("mad", "furious", "annoyed"), "calm"),
    "brave": (("courageous", "bold", "fearless"), "cowardly"),
    "cold": (("chilly", "cool", "freezing"), "hot"),
    "quiet": (("silent", "peaceful", "still"), "loud"),
    "rich": (("wealthy", "affluent", "prosperous"), "poor"),
    "beautiful": (("pretty", "lovely", "attractive"), "ugly"),
    "tired": (("sleepy", "exhausted", "weary"), "energetic"),
    "strong": (("powerful", "sturdy", "mighty"), "weak"),
    "buy": (("purchase", "acquire", "get"), "sell"),
    "empty": (("vacant", "bare", "hollow"), "full"),
    "ask": (("inquire", "question", "query"), "answer"),
    "kind": (("caring", "gentle", "friendly"), "cruel"),
    "clean": (("spotless", "tidy", "neat"), "dirty"),
    "true": (("correct", "accurate", "right"), "false"),
}

# English -> (Spanish, French, German)
TRANSLATIONS: dict[str, tuple[str, str, str]] = {
    "hello": ("hola", "bonjour", "hallo"),
    "goodbye": ("adiós", "au revoir", "auf Wiedersehen"),
    "thank you": ("gracias", "merci", "danke"),
    "please": ("por favor", "s'il vous plaît", "bitte"),
    "good morning": ("buenos días", "bonjour", "guten Morgen"),
    "good night": ("buenas noches", "bonne nuit", "gute Nacht"),
    "yes": ("sí", "oui", "ja"),
    "water": ("agua", "eau", "Wasser"),
    "cat": ("gato", "chat", "Katze"),
    "dog": ("perro", "chien", "Hund"),
    "house": ("casa", "maison", "Haus"),
    "book": ("libro", "livre", "Buch"),
    "friend": ("amigo", "ami", "Freund"),
    "bread": ("pan", "pain", "Brot"),
    "apple": ("manzana", "pomme", "Apfel"),
    "red": ("rojo", "rouge", "rot"),
    "how are you?": ("¿Cómo estás?", "Comment ça va ?", "Wie geht es dir?"),
    "I love you": ("Te quiero", "Je t'aime", "Ich liebe dich"),
    "where is the station?": ("¿Dónde está la estación?", "Où est la gare ?", "Wo ist der Bahnhof?"),
    "see you tomorrow": ("hasta mañana", "à demain", "bis morgen"),
    "the bill, please": ("la cuenta, por favor", "l'addition, s'il vous plaît", "die Rechnung, bitte"),
}
LANGUAGES: tuple[str, ...] = ("Spanish", "French", "German")

# animal -> (class, what it eats, habitat, fun fact, rough adult weight in kg or None if it varies a lot)
ANIMALS: dict[str, tuple[str, str, str, str, float | None]] = {
    "elephant": ("mammal", "plants such as grass, leaves, bark and fruit", "the savannas and forests of Africa and Asia", "Elephants are the largest land animals, and they use their trunks to drink, smell and pick things up.", 5000),
    "giraffe": ("mammal", "leaves, especially from acacia trees", "the savannas of Africa", "Giraffes are the tallest living animals, and their long necks let them eat leaves high up in trees.", 1000),
    "camel": ("mammal", "desert plants, grasses and leaves", "deserts in Africa and Asia", "A camel's hump stores fat, not water.", 500),
    "polar bear": ("mammal", "mostly seals", "the Arctic", "Polar bears have black skin under their thick, white-looking fur.", 450),
    "tiger": ("mammal", "large animals such as deer and wild boar", "forests and grasslands of Asia", "Tigers are the largest wild cats, and every tiger has its own pattern of stripes.", 200),
    "dolphin": ("mammal", "fish and squid", "oceans all over the world", "Dolphins breathe air through a blowhole on the top of their heads.", 200),
    "kangaroo": ("mammal", "grasses and other plants", "Australia", "Kangaroos carry their babies, called joeys, in a pouch.", 60),
    "penguin": ("bird", "fish, krill and squid", "mostly the Southern Hemisphere", "Penguins cannot fly, but they are excellent swimmers.", 20),
    "owl": ("bird", "small animals such as mice, insects and other birds", "forests and fields on almost every continent", "Owls can turn their heads about 270 degrees.", 1.5),
    "octopus": ("mollusk", "crabs, shrimp and other small sea animals", "oceans all over the world", "An octopus has three hearts and eight arms.", None),
    "frog": ("amphibian", "insects, worms and other small creatures", "ponds, wetlands and forests", "Many frogs absorb water through their skin instead of drinking it.", 0.05),
    "bat": ("mammal", "mostly insects, though some kinds eat fruit or nectar", "caves and forests around the world", "Bats are the only mammals that can truly fly.", 0.03),
    "hummingbird": ("bird", "flower nectar and small insects", "North and South America", "Hummingbirds can hover in place and even fly backwards.", 0.004),
    "shark": ("fish", "mostly fish and other sea animals", "oceans all over the world", "A shark's skeleton is made of cartilage, not bone.", None),
    "honeybee": ("insect", "nectar and pollen from flowers", "gardens, meadows and forests", "Honeybees tell each other where flowers are with a waggle dance.", 0.0001),
}
ANIMAL_PLURALS: dict[str, str] = {"octopus": "octopuses"}

# planet -> (order from the Sun, mean diameter in km, orbital period in Earth days, fun fact)
PLANETS: dict[str, tuple[int, int, int, str]] = {
    "Mercury": (1, 4879, 88, "It is the smallest planet and the closest one to the Sun."),
    "Venus": (2, 12104, 225, "It is the hottest planet because its thick carbon dioxide clouds trap heat."),
    "Earth": (3, 12742, 365, "It is the only planet known to have life."),
    "Mars": (4, 6779, 687, "It is called the Red Planet because its dust is rich in iron oxide."),
    "Jupiter": (5, 139820, 4333, "It is the largest planet, and its Great Red Spot is a storm bigger than Earth."),
    "Saturn": (6, 116460, 10759, "It is famous for its bright rings made of ice and rock."),
    "Uranus": (7, 50724, 30687, "It spins on its side, so its poles point almost toward the Sun."),
    "Neptune": (8, 49244, 60190, "It has the strongest winds measured in the solar system."),
}

# recipe -> (servings, ingredients as (quantity, singular unit or "", item), steps).
# Unit-less items are "singular|plural" so scaled quantities read correctly.
F = Fraction
RECIPES: dict[str, tuple[int, list[tuple[Fraction, str, str]], list[str]]] = {
    "pancakes": (4, [(F(3, 2), "cup", "flour"), (F(2), "tablespoon", "sugar"), (F(2), "teaspoon", "baking powder"), (F(5, 4), "cup", "milk"), (F(1), "", "egg|eggs"), (F(3), "tablespoon", "melted butter")],
                 ["Mix the flour, sugar and baking powder in a bowl.", "Whisk the milk, egg and melted butter, then stir them into the dry ingredients.", "Heat a lightly oiled pan over medium heat.", "Pour in about 1/4 cup of batter per pancake and cook until bubbles form, then flip and cook until golden."]),
    "scrambled eggs": (2, [(F(4), "", "egg|eggs"), (F(1, 4), "cup", "milk"), (F(1), "tablespoon", "butter"), (F(1, 4), "teaspoon", "salt")],
                       ["Beat the eggs with the milk and salt.", "Melt the butter in a pan over low heat.", "Add the eggs and stir gently until they are just set.", "Serve right away."]),
    "guacamole": (4, [(F(3), "", "ripe avocado|ripe avocados"), (F(1), "", "lime, juiced|limes, juiced"), (F(1, 2), "", "onion, finely chopped|onions, finely chopped"), (F(1), "", "tomato, diced|tomatoes, diced"), (F(1, 2), "teaspoon", "salt")],
                  ["Mash the avocados in a bowl.", "Stir in the lime juice and salt.", "Fold in the onion and tomato.", "Taste, adjust the salt and serve with tortilla chips."]),
    "tomato pasta": (2, [(F(200), "gram", "spaghetti"), (F(2), "tablespoon", "olive oil"), (F(2), "clove", "garlic, sliced"), (F(400), "gram", "canned tomatoes"), (F(1, 2), "teaspoon", "salt")],
                     ["Cook the spaghetti in salted boiling water until al dente.", "Warm the olive oil and fry the garlic for one minute.", "Add the tomatoes and salt and simmer for ten minutes.", "Toss the drained pasta with the sauce."]),
    "lemonade": (4, [(F(1), "cup", "fresh lemon juice"), (F(3, 4), "cup", "sugar"), (F(4), "cup", "cold water"), (F(2), "cup", "ice")],
                 ["Stir the sugar into the lemon juice until it dissolves.", "Add the cold water and mix well.", "Pour over ice and serve."]),
    "oatmeal": (1, [(F(1, 2), "cup", "rolled oats"), (F(1), "cup", "milk or water"), (F(1), "pinch", "salt"), (F(1), "tablespoon", "honey")],
                ["Bring the milk or water to a simmer with the salt.", "Stir in the oats and cook for about five minutes, stirring often.", "Top with honey and fruit if you like."]),
    "fruit salad": (4, [(F(2), "", "apple, diced|apples, diced"), (F(2), "", "banana, sliced|bananas, sliced"), (F(1), "cup", "grapes"), (F(1), "cup", "strawberries, halved"), (F(1), "tablespoon", "lemon juice")],
                    ["Put all the fruit in a large bowl.", "Drizzle with the lemon juice so the apples and bananas do not turn brown.", "Mix gently and chill before serving."]),
}

# destination -> travel tips
TRAVEL: dict[str, list[str]] = {
    "Paris": ["Visit the Louvre early in the morning to avoid the longest lines.", "Take the metro; it is fast and covers the whole city.", "See the Eiffel Tower at night, when it sparkles for a few minutes every hour.", "Try a fresh croissant from a local bakery.", "Walk along the Seine and through the Marais district."],
    "Tokyo": ["Get a rechargeable transit card such as Suica for trains and buses.", "Visit Senso-ji, the oldest temple in Tokyo, in Asakusa.", "Cross the famous Shibuya scramble crossing.", "Eat ramen or sushi at a small local restaurant.", "Remember that tipping is not customary in Japan."],
    "Rome": ["Book tickets for the Colosseum and the Vatican Museums in advance.", "Wear comfortable shoes; the old center is best explored on foot.", "Throw a coin into the Trevi Fountain.", "Try gelato and a simple plate of cacio e pepe.", "Carry a refillable bottle and use the free public drinking fountains."],
    "London": ["Pay for the Underground with a contactless card or an Oyster card.", "Many big museums, like the British Museum, are free to enter.", "Visit the Tower of London to see the Crown Jewels.", "Bring an umbrella; the weather changes quickly.", "Walk along the South Bank of the Thames."],
    "New York": ["Use the subway; it runs 24 hours a day.", "Take a walk or rent a bike in Central Park.", "Take the ferry to see the Statue of Liberty.", "Try a classic New York bagel or a slice of pizza.", "Check for discounted same-day Broadway tickets."],
    "Barcelona": ["Book tickets for the Sagrada Familia ahead of time.", "Visit Park Guell to see Gaudi's colorful mosaics.", "Eat tapas in the Gothic Quarter.", "Keep an eye on your belongings in crowded areas.", "Spend an afternoon at Barceloneta beach."],
    "Amsterdam": ["Rent a bike, but watch out for trams and follow the bike lanes.", "Book tickets for the Anne Frank House well in advance.", "Take a canal cruise to see the city from the water.", "Visit the Rijksmuseum to see works by Rembrandt.", "Try stroopwafels from a street market."],
}

# advice topic -> tips
ADVICE: dict[str, list[str]] = {
    "sleep better": ["Go to bed and wake up at the same time every day.", "Avoid screens for an hour before bed.", "Keep your bedroom dark, quiet and cool.", "Avoid caffeine in the afternoon and evening.", "Get some daylight and exercise during the day."],
    "study more effectively": ["Study in short sessions of about 25 minutes with short breaks.", "Test yourself instead of only rereading your notes.", "Review material a few days later to help you remember it.", "Put your phone in another room while you study.", "Explain the topic out loud as if you were teaching it."],
    "reduce stress": ["Take a few slow, deep breaths when you feel tense.", "Go for a short walk outside.", "Write down what is worrying you and one small step you can take.", "Talk to a friend or someone you trust.", "Make time for a hobby you enjoy."],
    "save money": ["Write down everything you spend for one month.", "Set up an automatic transfer to savings on payday.", "Cook at home more often instead of eating out.", "Wait 24 hours before buying anything you do not need.", "Cancel subscriptions you no longer use."],
    "start running": ["Begin with short intervals of running and walking.", "Get a pair of comfortable running shoes.", "Increase your distance slowly, by about ten percent a week.", "Warm up before you run and stretch afterwards.", "Run at a pace where you can still talk."],
    "learn a new language": ["Practice a little every day instead of a lot once a week.", "Learn the most common words first.", "Listen to podcasts or music in the language.", "Find a partner to practice speaking with.", "Do not be afraid of making mistakes."],
    "work from home productively": ["Set up a dedicated workspace.", "Keep regular working hours.", "Plan your three most important tasks each morning.", "Take real breaks away from your desk.", "Turn off notifications while you focus."],
}

JOKES: list[tuple[str, str]] = [
    ("Why did the scarecrow win an award? Because he was outstanding in his field.", "It is a pun: \"outstanding\" means excellent, but the scarecrow is also literally standing out in a field."),
    ("Why don't skeletons fight each other? They don't have the guts.", "\"Having the guts\" means having courage, and skeletons literally have no guts because they are only bones."),
    ("What do you call a fake noodle? An impasta.", "\"Impasta\" sounds like \"impostor\", someone who pretends to be someone else, and pasta is a noodle."),
    ("Why did the bicycle fall over? Because it was two tired.", "\"Two tired\" sounds like \"too tired\", and a bicycle has two tires."),
    ("What do you call a bear with no teeth? A gummy bear.", "A bear with no teeth would chew with its gums, and gummy bears are a kind of candy."),
    ("Why can't you give Elsa a balloon? Because she will let it go.", "Elsa sings \"Let It Go\" in the movie Frozen, and letting go of a balloon makes it fly away."),
    ("Why did the math book look sad? Because it had too many problems.", "Math books are full of problems to solve, and having problems also means having troubles."),
    ("What did the ocean say to the beach? Nothing, it just waved.", "Waves move onto the beach, and waving is also a friendly greeting."),
]

RIDDLES: list[tuple[str, str]] = [
    ("What has keys but can't open locks?", "A piano."),
    ("What gets wetter the more it dries?", "A towel."),
    ("What has hands but cannot clap?", "A clock."),
    ("What has to be broken before you can use it?", "An egg."),
    ("What goes up but never comes down?", "Your age."),
    ("What has a neck but no head?", "A bottle."),
    ("What can you catch but not throw?", "A cold."),
    ("What has many teeth but cannot bite?", "A comb."),
]

CATEGORIES: dict[str, list[str]] = {
    "fruits": ["apple", "banana", "orange", "mango", "pear", "grape", "strawberry", "pineapple", "cherry", "peach"],
    "vegetables": ["carrot", "broccoli", "spinach", "potato", "onion", "pepper", "cucumber", "tomato", "zucchini", "cabbage"],
    "colors": ["red", "blue", "green", "yellow", "purple", "orange", "pink", "brown", "black", "white"],
    "sports": ["soccer", "tennis", "basketball", "swimming", "cycling", "volleyball", "baseball", "golf", "running", "skiing"],
    "musical instruments": ["piano", "guitar", "violin", "drums", "flute", "trumpet", "cello", "saxophone", "clarinet", "harp"],
    "things you find in a kitchen": ["fridge", "oven", "kettle", "spoon", "frying pan", "cutting board", "toaster", "sink", "plate", "whisk"],
}

NAMES: list[str] = ["Alice", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kenji", "Lena", "Maya", "Noah", "Olivia", "Pablo", "Priya", "Sam", "Tara", "Yusuf"]
WORDS: list[str] = ["apple", "banana", "window", "garden", "pencil", "rocket", "yellow", "mountain", "library", "elephant", "orange", "kitten", "planet", "bottle", "summer", "coffee", "river", "silver", "button", "cookie", "balloon", "mirror", "tomato", "dragon", "jungle", "puzzle", "letter", "bubble", "sunset", "forest"]

# fmt: on


# ---- text helpers shared by the task modules ----
def join_list(items: list[str], conj: str = "and") -> str:
    """'a', 'a and b', 'a, b and c'."""
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + f" {conj} " + items[-1]


def fmt_num(x: float, digits: int = 2) -> str:
    """Round to `digits` decimals and drop trailing zeros (3.50 -> '3.5', 4.0 -> '4')."""
    s = f"{round(x, digits):.{digits}f}"
    return s.rstrip("0").rstrip(".") if "." in s else s


def fmt_frac(q: Fraction) -> str:
    """A kitchen quantity: 3/2 -> '1 1/2', 1/4 -> '1/4', 2 -> '2'."""
    whole, rest = divmod(q.numerator, q.denominator)
    if rest == 0:
        return str(whole)
    frac = f"{rest}/{q.denominator}"
    return f"{whole} {frac}" if whole else frac


def cap(s: str) -> str:
    """Capitalize only the first character ('the Netherlands' -> 'The Netherlands')."""
    return s[:1].upper() + s[1:]


def a_an(noun: str) -> str:
    """Prefix the indefinite article ('owl' -> 'an owl'); good enough for our word lists."""
    return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun


def plural(n: int, word: str) -> str:
    """'1 day', '3 days'."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def money(cents: int) -> str:
    """Integer cents -> '$12.05' (integer cents keep the arithmetic exact)."""
    return f"${cents // 100}.{cents % 100:02d}"


def bullets(rng: random.Random, items: list[str]) -> str:
    """Numbered or dashed list, chosen at random for style variety."""
    if rng.random() < 0.5:
        return "\n".join(f"{i}. {t}" for i, t in enumerate(items, 1))
    return "\n".join(f"- {t}" for t in items)
