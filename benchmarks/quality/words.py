"""Vocabulary and text of the synthetic tasks, written for this project.

* ``WORDS``: plain English words (no digits, no hyphens, each a separate word), for needle keys and the
  common-word task;
* ``prose``: an endless, seeded stream of simple English sentences from a small grammar, a haystack that
  reads like text without repeating itself (the other haystack, ``NOISE``, repeats one line);
* ``coded_word``: pronounceable nonsense words for the frequent-word task.

Nothing here contains a digit, so the numbers a task hides are the only numbers in its prompt.
"""

from __future__ import annotations

import random
from typing import Iterator

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

WORDS = tuple("""
able acid actor adult advice agent air airport album alley amber angle animal answer anvil apple apron arch
area arena army arrow artist aspen atlas attic autumn avenue award axis baby bacon badge bakery balcony
ballet bamboo banana band banner barn barrel basket battery beach beacon beard beaver bedroom bee beetle
bell belt bench berry bicycle bird biscuit blanket blossom boat bonnet book boot border bottle boulder
bowl box bracelet branch brass bread brick bridge broom brush bubble bucket buffalo bugle building bulb
bundle butter button cabin cable cactus cake camel camera camp canal candle canoe canvas canyon captain
card carpet carrot castle cattle cave cedar ceiling cellar cement chair chalk channel chapel cherry chess
chimney choir cider circle city clay cliff clock cloud clover coast cobalt coffee coin comet compass copper
coral cotton cougar county courage cousin cradle crane crater crayon creek cricket crow crown crystal cup
curtain cushion dagger daisy dancer dawn debate deer delta desert desk diamond dinner doctor dolphin
donkey door dragon drawer dream drum duck dune eagle easel echo eel elbow elephant elm ember emerald
engine envelope falcon farm feather fence fern ferry festival fiddle field fig finch fire fish flag flame
flute fog forest fork fossil fountain fox frame frost fruit furnace galaxy garden garlic gate gazelle gem
ginger giraffe glacier glass glove goat gold goose grape grass gravel guitar gull hammer harbor harp hat
hawk hazel heart hedge helmet heron hill hive honey hook horizon horn horse hotel house island ivory
jacket jaguar jar jasmine jelly jewel journal judge jungle kettle key kitchen kite kitten knife ladder
lagoon lake lamb lamp lantern laser lava lawn leaf lemon lens letter library lily lime linen lion lizard
lobster locket lodge loom lotus lumber magnet mango map maple marble market marsh meadow melon mercury
meteor mill mint mirror mitten monkey moon moose mosaic moss motor mountain mouse mule museum needle
nest net nickel night noodle novel nugget oak oar oasis ocean octopus olive onion opal orange orbit
orchard orchid otter owl oyster paddle page palace panda panther paper parade parcel parrot pasta peach
pearl pebble pelican pencil pepper piano pickle pigeon pillow pilot pine pirate planet plum pocket poem
pond poppy porch potato pottery prairie pumpkin puppet quarry quartz queen quill rabbit raccoon radio
raft rain ranch raven reef ribbon rice riddle ring river road robin rocket roof rope rose ruby saddle
sail salmon salt sand satin saucer scarf school scroll seal shadow shell shelf ship shoe shovel silk
silver singer sketch sled slipper snail snow soap sofa soup sparrow spider spoon spring squirrel stable
stair star statue steam stone storm stove straw stream street sugar summit sunset swan sweater table
tablet tailor teapot temple tent thistle thread thunder tiger timber toast tomato torch tower tractor
trail train tree trumpet tulip tunnel turkey turtle umbrella valley vase velvet village violet violin
volcano wagon walnut walrus wand wave whale wheat wheel whistle willow window winter wizard wolf wool
yacht yarn zebra zinc
""".split())

ADJECTIVES = tuple("""
ancient bitter bold brave bright broad calm careful cheerful clever cold crisp curious damp dark deep
distant dusty eager early empty faint famous fierce gentle giant golden grand green hidden hollow honest
humble icy jolly keen large lazy little lively lonely loud lucky mellow mighty modest narrow noble odd
old pale patient plain polite proud purple quick quiet rapid rare restless rich rough round rusty sandy
scarlet secret sharp shy silent simple sleepy slow small smooth soft solid sour steady steep stormy
strange strong sudden sunny swift tall tame tender thick tidy tiny tired vast warm weary wild wise
wooden young
""".split())

_VERBS = tuple("""
admired borrowed built carried chased cleaned collected crossed described discovered drew explored
fixed followed found gathered guarded painted passed planted polished praised repaired sold studied
visited watched
""".split())

_PLACES = tuple("""
the harbor|the old mill|the village square|the mountain pass|the river bank|the market|the library|
the orchard|the train station|the quiet valley|the north road|the lighthouse|the school yard|the bakery|
the forest edge|the stone bridge|the museum|the farm|the island|the city gate
""".replace("\n", "").split("|"))

_TIMES = tuple("""
at dawn|in the evening|after the storm|before the festival|during the winter|on a rainy morning|
late at night|in early spring|after lunch|on the last day of summer|while the bells rang|at sunset
""".replace("\n", "").split("|"))

_PEOPLE = tuple("""
the baker|the captain|an old farmer|the young painter|a traveling singer|the teacher|the mayor|a shy student|
the fisherman|a tired pilot|the librarian|a clever tailor|the gardener|a quiet doctor|the carpenter
""".replace("\n", "").split("|"))

# Sentence shapes of the prose haystack; {p} a person, {a} an adjective, {w} a word, {v} a verb,
# {l} a place, {t} a time.
_SHAPES = (
    "{P} {v} the {a} {w} near {l} {t}.",
    "Nobody in {l} remembered who had {v} the {w}.",
    "{T}, {p} walked to {l} with a {a} {w}.",
    "The {w} at {l} was {a}, and everyone noticed it.",
    "{P} said that the {w} looked {a} {t}.",
    "Some people believe the {a} {w} came from {l}.",
    "{T}, the {w} and the {w2} were left beside {l}.",
    "{P} kept a {a} {w} on the shelf for many years.",
    "There was a {a} {w} in {l}, but {p} did not see it.",
    "It is said that {p} once {v} a {w} made of {w2}.",
)


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def prose(rng: random.Random) -> Iterator[str]:
    """Endless sentences drawn with ``rng``: the same seed gives the same stream, so a longer haystack
    extends a shorter one."""
    while True:
        shape = rng.choice(_SHAPES)
        person, time = rng.choice(_PEOPLE), rng.choice(_TIMES)
        fields = dict(p=person, P=_cap(person), t=time, T=_cap(time), a=rng.choice(ADJECTIVES),
                      w=rng.choice(WORDS), w2=rng.choice(WORDS), v=rng.choice(_VERBS), l=rng.choice(_PLACES))
        yield shape.format(**fields)


_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


def coded_word(rng: random.Random) -> str:
    """A pronounceable nonsense word of 2 or 3 syllables, e.g. 'tavobi'."""
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.choice((2, 3))))
