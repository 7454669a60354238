"""Real English text for the accuracy harness and the end-to-end tests that run the real model (SmolLM2-135M-Instruct,
triton_offload.models): eight encyclopedic passages written for this project, and prompts cut from them to an exact
number of tokens. :func:`text_ids` keeps the tests' block arithmetic (200 tokens: 6 GPU blocks of 32 and the last
token recomputed); prompts of different seeds start with different passages, so they share no leading block.
:func:`prompt_set` gives the accuracy harness up to 248 prompts of a few hundred tokens, no two starting alike."""

from __future__ import annotations

PASSAGES = (
    "The history of Paris begins around the third century BC, when a Celtic people known as the Parisii settled on an "
    "island in the river Seine. The Romans conquered the area in 52 BC and built a town they called Lutetia on the "
    "left bank, with a forum, baths and an amphitheatre. In the centuries that followed, the town grew slowly, and by "
    "the Middle Ages Paris had become one of the largest cities in Europe, a centre of learning, trade and religion. "
    "The cathedral of Notre-Dame was begun in 1163 on the island where the Parisii had lived, and the university drew "
    "students from every corner of the continent. Kings made the city their capital, and each left a mark on it: "
    "walls, palaces, bridges and squares. In the nineteenth century the prefect Haussmann cut wide boulevards through "
    "the crowded medieval streets, laid new sewers and parks, and gave the city the long stone facades it is known "
    "for today. The Eiffel Tower, built for the world's fair of 1889, was meant to stand for twenty years; it became "
    "the symbol of the city instead.",
    "Water on Earth moves in a continuous cycle. The sun heats the surface of oceans, lakes and rivers, and part of "
    "the water evaporates into the air as an invisible gas. Plants release water vapour through their leaves as well, "
    "a process called transpiration. As warm, moist air rises, it cools, and the vapour condenses into tiny droplets "
    "that form clouds. When the droplets grow heavy enough, they fall back to the ground as rain, snow, sleet or hail. "
    "Some of this precipitation runs off the land into streams and rivers, which carry it back to the sea. Some soaks "
    "into the soil and becomes groundwater, which can stay underground for thousands of years before it reaches a "
    "spring or a well. In cold regions, snow piles up year after year and is pressed into glacial ice. The total "
    "amount of water on the planet hardly changes, but its form and its place change all the time, and this movement "
    "shapes the weather, carves valleys and supplies the fresh water that every living thing depends on.",
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light into chemical energy. "
    "Inside the leaves of a plant are cells packed with chloroplasts, small structures that contain a green pigment "
    "called chlorophyll. Chlorophyll absorbs red and blue light and reflects green light, which is why leaves look "
    "green to us. Using the energy of the absorbed light, the plant splits water molecules taken up by its roots, "
    "releasing oxygen into the air. The hydrogen from the water is then combined with carbon dioxide, which enters "
    "the leaf through tiny pores called stomata, to build sugars such as glucose. The plant uses these sugars for "
    "energy and as building blocks for starch and cellulose. Almost all the oxygen in the atmosphere was produced by "
    "photosynthesis, and nearly every food chain on Earth starts with it: animals eat plants, or eat other animals "
    "that ate plants. Without photosynthesis, life as we know it could not exist.",
    "The solar system formed about four and a half billion years ago from a cloud of gas and dust. Most of the "
    "material collapsed into the centre and became the sun, while the rest flattened into a spinning disk in which "
    "the planets grew. The four inner planets, Mercury, Venus, Earth and Mars, are small and rocky. Beyond them lies "
    "the asteroid belt, a ring of rocky fragments that never came together into a planet. The four outer planets are "
    "giants: Jupiter and Saturn are made mostly of hydrogen and helium, while Uranus and Neptune contain more ice. "
    "Jupiter is so large that all the other planets would fit inside it. Saturn is famous for its bright rings of ice "
    "and rock. Farther out still, past the orbit of Neptune, the Kuiper belt holds Pluto and many other icy bodies, "
    "and comets travel in from the distant Oort cloud. Light from the sun takes about eight minutes to reach the "
    "Earth, and more than four hours to reach Neptune.",
    "Before the printing press, books in Europe were copied by hand, usually by monks working in monasteries. A single "
    "copy of the Bible could take a scribe more than a year to finish, so books were rare and expensive. Around 1440, "
    "Johannes Gutenberg, a goldsmith in the German city of Mainz, developed a way to print with movable metal type. "
    "He cast individual letters from an alloy of lead, tin and antimony, arranged them into lines and pages, inked "
    "them, and pressed paper against them with a screw press adapted from those used to make wine. The letters could "
    "be reused for page after page. Gutenberg's Bible, finished around 1455, was the first major book printed this "
    "way. Within fifty years, printing shops had spread to more than two hundred cities, and millions of books had "
    "been produced. Ideas now travelled faster than ever before, which helped to spread the Renaissance, the "
    "Reformation and the scientific revolution across the continent.",
    "Honeybees live in colonies that can contain tens of thousands of insects. Each colony has a single queen, whose "
    "main task is to lay eggs, sometimes more than a thousand in a day. Most of the bees are female workers. Young "
    "workers clean the cells of the hive, feed the larvae and build wax comb; older workers guard the entrance and "
    "fly out to collect nectar and pollen from flowers. The males, called drones, do not work; their only role is to "
    "mate with a queen from another colony. A forager that finds a good patch of flowers returns to the hive and "
    "performs a waggle dance, whose direction and length tell the other bees where the food is and how far away. "
    "Nectar is stored in the comb and fanned by the bees until most of its water evaporates, turning it into honey, "
    "which feeds the colony through the winter. By carrying pollen from flower to flower, bees also pollinate many of "
    "the crops that people grow for food.",
    "The Romans built one of the greatest road networks of the ancient world. At its height, the empire was linked by "
    "more than eighty thousand kilometres of paved roads, running from Britain to Syria and from the Rhine to North "
    "Africa. Roman engineers laid their roads in layers: a foundation of large stones, then smaller stones and gravel "
    "set in lime, and finally a surface of tightly fitted paving slabs. The roads were slightly curved so that rain "
    "would run off into ditches on either side. Wherever they could, the builders made them straight, cutting through "
    "hills and crossing rivers and valleys on stone bridges. Milestones along the way told travellers the distance to "
    "the next town. The roads were built first for the army, so that legions could march quickly to the frontiers, "
    "but merchants, officials and messengers used them too. Many modern roads in Europe still follow the routes the "
    "Romans laid out two thousand years ago.",
    "The steam engine changed the way people worked and travelled. Early engines, built in England at the start of the "
    "eighteenth century, were used to pump water out of coal mines. They were large and wasted most of the heat of "
    "the fuel they burned. In the 1760s, the Scottish instrument maker James Watt added a separate condenser, so that "
    "the cylinder no longer had to be cooled and heated again at every stroke, and the engine used far less coal. "
    "Watt and his partner Matthew Boulton went on to build engines that turned wheels, and factories no longer needed "
    "to stand beside fast rivers to drive their machines. In the following decades, steam engines were put on wheels "
    "and on boats. The first public railway to carry passengers behind a steam locomotive opened in 1825, and within "
    "a few decades railways crossed whole countries and continents, carrying goods and people faster and more cheaply "
    "than ever before.",
)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def text_ids(tokenizer, seed: int, length: int, prefix: list[int] = ()) -> list[int]:
    """``length`` token ids: ``prefix`` followed by passage ``seed`` (modulo their number) and those after it, as
    many as it takes, cut to ``length``."""
    ids = list(prefix)
    for i in range(len(PASSAGES)):
        if len(ids) >= length:
            break
        ids += _ids(tokenizer, (" " if ids else "") + PASSAGES[(seed + i) % len(PASSAGES)])
    assert len(ids) >= length, f"the passages hold fewer than {length} tokens"
    return ids[:length]


STEP_WORDS = 5  # prompts of one passage start this many words apart
LENGTHS = (256, 448)  # a prompt's tokens, at least and at most


def prompt_set(tokenizer, count: int, shortest: int = LENGTHS[0], longest: int = LENGTHS[1]) -> list[list[int]]:
    """``count`` prompts of ``shortest`` to ``longest`` tokens: prompt ``i`` starts at word ``STEP_WORDS * (i // 8)``
    of passage ``i % 8`` and goes on through the passages after it, cut at a length drawn from ``i``. No two start
    alike (at most 8 x 31 = 248 prompts: the shortest passage has 158 words)."""
    n, words = len(PASSAGES), [p.split(" ") for p in PASSAGES]
    most = n * (min(len(w) for w in words) // STEP_WORDS)
    assert count <= most, f"at most {most} prompts"
    prompts = []
    for i in range(count):
        first, start = i % n, STEP_WORDS * (i // n)
        text = " ".join([" ".join(words[first][start:]), *(PASSAGES[(first + j) % n] for j in range(1, n))])
        length = shortest + (i * 37) % (longest - shortest + 1)
        prompts.append(_ids(tokenizer, text)[:length])
    return prompts
