"""Write specdec/data/general.jsonl: general prompts (chat, explanations, writing, rewriting, translation,
summaries and questions over a passage) for training drafters on more than GSM8K.

Usage (from the repository root):  python scripts/make_general_prompts.py

Every subject, sentence, passage and template below was written for this package and is released with
specdec under its own licence. The prompts are the templates filled in with the subjects; which
templates a subject gets is decided by a fixed hash of the two (never Python's random module), so
re-running the script rewrites the shipped file byte for byte. The responses are not shipped: a
drafter trains on the target's own continuations (`specdec train ... --data self --prompts general`).
None of these prompts appears in the benchmark sets (mixed, heldout, gsm8k-eval);
tests/test_general_prompts.py checks that no prompt shares a run of eight words with them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "specdec" / "data" / "general.jsonl"
SALT = "specdec-general-v1:"

EXPLAIN = [
    "how a compass finds north", "why bread dough rises", "how noise-cancelling headphones work",
    "what inflation is", "how a bill becomes a law in a parliament", "why ice floats on water",
    "how tides are caused by the Moon", "what a credit score measures", "how a solar panel makes electricity",
    "why we dream", "how an electric motor turns", "what the stock market is", "how recycling of glass works",
    "why leaves change colour in autumn", "how a lock and key work", "what an API is in software",
    "how GPS works out your position", "why the ocean is salty", "how a thermostat controls a room's temperature",
    "what a black hole is", "how a touch screen senses a finger", "why some people are allergic to pollen",
    "how an aeroplane wing creates lift", "what compound interest is", "how a camera lens focuses light",
    "why cats purr", "how a spreadsheet formula works", "what DNA does in a cell", "how a dam produces power",
    "why metal feels colder than wood at the same temperature", "how a search engine ranks pages",
    "what a budget deficit is", "how earthquakes happen", "why we need sleep", "how a 3D printer builds an object",
    "what encryption is", "how a hot-air balloon rises", "why onions make people cry", "how a heat pump works",
    "what a carbon footprint is", "how a barcode scanner reads a label", "why the Moon has phases",
    "how coffee is decaffeinated", "what machine learning is", "how a submarine dives and surfaces",
    "why rivers bend and meander", "how a credit card payment is processed", "what an election poll measures",
    "how a wind turbine turns wind into electricity", "why yawning seems to be contagious",
    "how the human ear hears sound", "what a password manager does", "how soap removes grease",
    "why some metals rust and others do not", "how a library classifies its books", "what a podcast is",
    "how bees make honey", "why planes leave white trails in the sky", "how a washing machine spins clothes dry",
    "what a time zone is",
]
EXPLAIN_TEMPLATES = [
    "Explain {x} in simple terms.", "Can you explain {x}? Keep it short.", "Give me a clear explanation of {x}.",
    "Explain {x} to someone with no background in the subject.", "In a few sentences, explain {x}.",
]

COMPARE = [
    ("a lake", "a pond"), ("a crocodile", "an alligator"), ("a loan", "a grant"), ("RAM", "storage"),
    ("a simile", "a metaphor"), ("a republic", "a monarchy"), ("baking soda", "baking powder"),
    ("a hurricane", "a tornado"), ("a debit card", "a credit card"), ("a novel", "a novella"),
    ("an asteroid", "a comet"), ("a violin", "a viola"), ("renting", "buying a home"), ("a tortoise", "a turtle"),
    ("a compiler", "an interpreter"), ("speed", "velocity"), ("a museum", "a gallery"), ("jam", "jelly"),
    ("a frog", "a toad"), ("an email", "a letter"), ("a marathon", "a half marathon"), ("wool", "cotton"),
    ("a city", "a town"), ("a herb", "a spice"), ("a sprint", "a long run"), ("a laptop", "a tablet"),
    ("a mountain", "a hill"), ("a poem", "a song"), ("a bus", "a tram"), ("an apprenticeship", "a degree"),
    ("a river", "a canal"), ("tea", "coffee"), ("a rabbit", "a hare"), ("a journal", "a diary"),
    ("a bakery", "a patisserie"), ("a cold", "the flu"), ("an ocean", "a sea"), ("a hobby", "a job"),
]
COMPARE_TEMPLATES = [
    "What is the difference between {a} and {b}?", "How is {a} different from {b}?",
    "Compare {a} and {b} in a few sentences.", "Which is which: {a} or {b}? Explain how to tell them apart.",
]

HOWTO = [
    "make a good cup of tea", "change a flat tyre on a car", "write a clear cover letter", "start a vegetable garden",
    "learn to touch type", "clean a cast-iron pan", "plan a budget for a month", "prepare for a long flight",
    "make a simple paper aeroplane", "set up a new email account", "keep a conversation going with a stranger",
    "fold a shirt neatly", "remember people's names", "make a fruit smoothie", "save money on groceries",
    "write a short speech for a wedding", "organise a small bookshelf", "get better at chess",
    "take a good photo with a phone", "learn a few words of a new language every day", "boil an egg perfectly",
    "give constructive feedback to a colleague", "plan a picnic", "keep a small aquarium clean",
    "sharpen a kitchen knife", "pack a suitcase for a week", "write a simple to-do list that works",
    "stay focused while studying", "hang a picture on a wall", "make pancakes from scratch",
    "prepare for a driving test", "teach a dog to sit", "back up the photos on a computer",
    "plan a surprise birthday party", "care for a cactus", "write a polite complaint to a company",
    "learn to juggle three balls", "reduce the clutter in a small flat", "make a paper lantern",
    "start keeping a journal", "read a map without a phone", "brew coffee with a French press",
    "choose a good watermelon", "practise a presentation before giving it", "make friends in a new city",
]
HOWTO_TEMPLATES = [
    "How do I {x}?", "What is the best way to {x}? Give the steps.", "Give me step-by-step instructions to {x}.",
    "I have never tried to {x}. Where should I start?",
]

SCENE_FORMS = ["a short poem", "a two-paragraph story", "a limerick", "a diary entry", "a short news report", "a haiku"]
SCENES = [
    "an old clock that stopped at midnight", "a robot learning to bake bread", "the first day of spring",
    "a lost umbrella on a train", "a night market by the river", "a ferry captain's dog",
    "a library at closing time", "a kite that would not fly", "a mountain village in winter", "the last day of school",
    "a dragon afraid of the dark", "a quiet beach in the early morning", "a student's first exam",
    "a bicycle repair shop", "a family of ducks crossing a road", "a snowstorm in the city", "a garden after the rain",
    "a street musician", "moving to a new country", "a small bakery that opens at dawn",
    "a train journey across the desert", "an astronaut looking back at Earth", "a friendship between a fox and a crow",
    "an abandoned greenhouse", "a child's first swimming lesson", "a city park at night",
]
PRODUCT_FORMS = ["a product description", "a short advertisement", "a short customer review", "a short poem"]
PRODUCTS = [
    "a new pair of running shoes", "a reusable water bottle", "a wristwatch that tells the weather", "a new coffee machine",
    "a folding bicycle", "a solar-powered torch", "a wooden chess set", "a handmade ceramic mug",
    "a plant pot that waters itself", "a waterproof backpack",
]
WRITE_TEMPLATES = ["Write {form} about {subject}.", "Please write {form} about {subject}."]

ADVICE = [
    "I find it hard to wake up early in the morning", "my neighbours are noisy late at night",
    "I want to read more books but never find the time", "I am moving to a city where I know nobody",
    "I spend too much time on my phone", "I have to give a presentation to my whole team next week",
    "my houseguest is staying longer than planned", "I want to eat more vegetables", "I forget to drink enough water",
    "I want to learn to cook but I only have a small kitchen", "I disagree with a friend about holiday plans",
    "I want to ask my manager for a raise", "I get nervous before exams", "my desk is always messy",
    "I want to start saving for a holiday", "I keep losing my keys", "I want to learn to draw as an adult",
    "I have a long commute and want to use the time well", "my teenager does not talk to me much",
    "I want to volunteer but do not know where to start", "I find it hard to say no to extra work",
    "I want to get back into a sport I stopped years ago", "my phone battery runs out by lunchtime",
    "I have too many unread emails", "I want to make my small flat feel bigger",
]
ADVICE_TEMPLATES = ["{x}. What would you suggest?", "{x}. Can you give me some practical advice?",
                    "Any tips? {x}."]

LISTS = [
    "ten words that rhyme with 'light'", "five board games for a family evening", "six ways to reuse glass jars",
    "five questions to ask when viewing a flat", "eight things to pack for a camping trip",
    "five ideas for a cheap day out", "seven common kitchen herbs and what they go with",
    "five tips for writing a clear email", "six stretches to do after sitting all day",
    "five famous bridges and where they are", "ten animals that live in the Arctic", "five easy dishes to cook for a crowd",
    "six ideas for a school science project", "five ways to make a room quieter", "eight fruits high in vitamin C",
    "five crafts to make from old newspapers", "six tips for a long car journey", "five hobbies that cost little",
    "seven words for 'happy' and how they differ", "five things to check before buying a used car",
]
LIST_TEMPLATES = ["List {x}.", "Give me {x}, with a short note on each."]

SENTENCES = [
    "The meeting has been moved to Thursday afternoon because the room is being painted.",
    "Please remember to bring a warm coat, as the evenings are getting colder.",
    "Our shop will be closed on Monday for the public holiday.",
    "The train to the coast leaves every hour from platform four.",
    "I would like to book a table for three people at seven o'clock.",
    "The new library opens next month and has a large reading room for children.",
    "Could you tell me where the nearest pharmacy is?",
    "We have decided to plant apple trees along the edge of the field.",
    "The museum is free on the first Sunday of every month.",
    "My sister is learning to play the piano and practises every evening.",
    "The river flooded the lower streets after three days of heavy rain.",
    "Thank you for your letter; I was very happy to hear from you.",
    "The bakery sells fresh bread until the early afternoon.",
    "Turn left at the church and walk straight on for two hundred metres.",
    "The concert was cancelled because the singer had lost her voice.",
    "We are looking for volunteers to help clean the beach on Saturday.",
    "The recipe needs two eggs, a cup of flour and a little milk.",
    "He missed the last bus and had to walk home in the dark.",
    "The hotel room has a small balcony with a view of the harbour.",
    "Students must hand in their projects before the end of the week.",
]
LANGUAGES = ["French", "German", "Spanish", "Italian"]
REWRITES = ["Rewrite this sentence so that it sounds more formal: \"{s}\"",
            "Make this sentence simpler for a young reader: \"{s}\"",
            "Rewrite this sentence in the past tense: \"{s}\""]

PASSAGES = [
    "Once a month the town hall of Mirefield turns into a repair cafe. Residents bring broken lamps, torn coats, "
    "wobbly chairs and radios that no longer work, and volunteers with tools show them how to fix the things "
    "themselves. Nothing is charged, though there is a jar for donations towards spare parts. Last year the cafe "
    "counted more than nine hundred repairs, and the volunteers estimate that they kept about two tonnes of "
    "household goods out of the rubbish tip.",
    "Calder Ferries runs two boats between the mainland and the island of Tarn. In summer each boat makes eight "
    "crossings a day, but in winter the timetable drops to three because storms often close the harbour. "
    "Islanders have asked for a smaller third boat that could sail in rough weather. The company says a new boat "
    "would cost about four million pounds and that it will decide next year, after a study of winter demand.",
    "A group of students at Linden College built a weather station on the roof of the science block. It records "
    "temperature, wind speed and rainfall every ten minutes and posts the readings to a public web page. The "
    "students found that the roof was on average two degrees warmer than the playing fields, which they think is "
    "caused by the dark surface. They now plan to paint part of the roof white and measure the difference.",
    "The mountain rescue team in the Ardle hills bought its first drone last spring. The drone carries a heat "
    "camera that can find a person lying in the heather at night, when a search on foot would take hours. In its "
    "first year it helped in eleven call-outs, and in two of them it found the missing walker before the team "
    "reached the area. The team still trains every week with maps and compasses, because the drone cannot fly "
    "in strong winds or heavy snow.",
    "Every autumn the hedgehog rescue centre at Brook Farm takes in young hedgehogs that are too small to "
    "survive the winter. A hedgehog needs to weigh about six hundred grams before it hibernates. The centre "
    "feeds them until they reach that weight and keeps them in quiet sheds over the cold months. In spring the "
    "animals are released in gardens whose owners have promised not to use slug pellets.",
    "Pellworth's public swimming pool was built in 1936 and closed in 2019 because of a leaking roof. A local "
    "campaign raised half of the money for repairs through events such as a sponsored swim in the sea. The "
    "council agreed to pay the rest if the pool stays open to schools on weekday mornings. The repaired pool "
    "reopened this summer with solar panels that heat the water on sunny days.",
    "The Orrin Valley cheese makers use milk from a single herd of goats that graze on the hillsides. The cheese "
    "is pressed into small rounds and left to age in a cave for at least three months. Because the goats eat "
    "different plants as the seasons change, the flavour of the cheese changes too: spring cheese is mild and "
    "grassy, while autumn cheese is stronger and slightly nutty.",
    "The fish auction in the harbour town of Kelby used to start at five in the morning, with buyers standing "
    "on the quay as each box was sold by a shouting auctioneer. Two years ago the auction moved online: boats "
    "photograph their catch at sea and buyers bid from their phones before the boats land. Prices have become "
    "more stable, and restaurants far inland now buy directly. Some older traders miss the quay, and a small "
    "live auction is still held on Friday mornings for visitors.",
    "The old railway line between Stenby and Ashgrove closed in 1965. Its track was removed, and for years the "
    "route was overgrown. Ten years ago a charity cleared it and laid a gravel path along the fourteen-kilometre "
    "route. The path is now used by walkers, cyclists and horse riders, and the old stations have become a cafe, "
    "a bicycle hire shop and a small museum about the railway.",
    "The Ashby bakery switched from an electric oven to a wood-fired one built of local brick. The oven takes "
    "three hours to heat up, so the baker lights it at two in the morning and bakes the first loaves at five. "
    "The wood comes from trees cut down by the council in the town's parks. Customers say the bread has a "
    "thicker crust and keeps fresh for longer, and the bakery now sells out most days before noon.",
    "The Greystone community orchestra has no auditions: anyone who can play an instrument may join. It rehearses "
    "on Tuesday evenings in a school hall and gives three concerts a year. Its youngest member is eleven and its "
    "oldest is eighty-four. Tickets are free, but the audience is asked to bring food for the local food bank, "
    "and the last concert collected more than two hundred kilograms.",
    "When the village shop in Hollin closed, residents formed a cooperative and bought the building. Each member "
    "paid twenty pounds for a share and has one vote, whatever the size of their share. The shop is run by two "
    "paid staff and a rota of volunteers. It stocks local vegetables, eggs and bread, and it also serves as the "
    "village post office and a place where people leave messages for each other.",
]
PASSAGE_TEMPLATES = [
    "Summarise this passage in one sentence.\n\n{p}",
    "Read the passage and list its main facts as bullet points.\n\n{p}",
    "Suggest a short title for this passage and explain your choice.\n\n{p}",
    "What is the main point of the following passage? Answer in two sentences.\n\n{p}",
    "Here is a passage:\n\n{p}\n\nWrite three questions a reader could answer from it, with their answers.",
    "Explain the following passage to a ten-year-old reader.\n\n{p}",
]


def picks(key: str, options: list[str], n: int) -> list[str]:
    """n of `options` (all where n >= len), chosen by a fixed hash of key: a template per subject that stays
    the same from run to run and machine to machine."""
    ranked = sorted(options, key=lambda o: hashlib.sha256(f"{SALT}{key}|{o}".encode()).hexdigest())
    return ranked[:n]


def prompts() -> list[tuple[str, str]]:
    """(category, prompt) for every prompt, in a fixed order."""
    out: list[tuple[str, str]] = []
    out += [("explain", t.format(x=x)) for x in EXPLAIN for t in picks(x, EXPLAIN_TEMPLATES, 2)]
    out += [("compare", t.format(a=a, b=b)) for a, b in COMPARE for t in picks(a + b, COMPARE_TEMPLATES, 2)]
    out += [("howto", t.format(x=x)) for x in HOWTO for t in picks(x, HOWTO_TEMPLATES, 2)]
    for subjects, forms in ((SCENES, SCENE_FORMS), (PRODUCTS, PRODUCT_FORMS)):
        for subject in subjects:
            for form in picks(subject, forms, 3):
                out.append(("writing", picks(subject + form, WRITE_TEMPLATES, 1)[0].format(form=form, subject=subject)))
    out += [("advice", t.format(x=x)) for x in ADVICE for t in picks(x, ADVICE_TEMPLATES, 2)]
    out += [("lists", t.format(x=x)) for x in LISTS for t in LIST_TEMPLATES]
    for s in SENTENCES:
        out += [("rewrite", t.format(s=s)) for t in picks(s, REWRITES, 2)]
        out += [("translation", f"Translate into {lang}: \"{s}\"") for lang in picks(s, LANGUAGES, 2)]
    out += [("passage", t.format(p=p)) for p in PASSAGES for t in PASSAGE_TEMPLATES]
    return out


def main() -> int:
    lines = [json.dumps({"question_id": i + 1, "category": c, "turns": [p]}, ensure_ascii=False)
             for i, (c, p) in enumerate(prompts())]
    OUT.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} prompts to {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
