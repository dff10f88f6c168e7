"""Training prompts for self-distillation: never Spec-Bench.

Two sources: GSM8K *train* questions (a ``train.jsonl`` the caller names: ``gsm8k_file``) and
instructions built here from templates over topics and texts written for this file
(summarise / translate / QA / explain / write / role-play / rewrite), so the drafters see
the kinds of tasks Spec-Bench measures without ever seeing its prompts.

    >>> ps = build_prompts(gsm8k_questions=["What is 2+3?"], n_instructions=3, seed=0)
    >>> len(ps), sum(p["source"] == "gsm8k" for p in ps)
    (4, 1)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TOPICS = (
    "the water cycle", "volcanoes", "honey bees", "the printing press", "black holes",
    "photosynthesis", "the Roman Empire", "electric cars", "coral reefs", "the internet",
    "vaccines", "the moon landing", "coffee", "climate change", "the human heart",
    "earthquakes", "chess", "the French Revolution", "solar panels", "penguins",
    "machine learning", "the Great Wall of China", "rainforests", "bicycles", "jazz music",
    "the stock market", "recycling", "dinosaurs", "the Olympic Games", "sleep",
    "antibiotics", "the Silk Road", "glaciers", "smartphones", "the immune system",
    "renewable energy", "ancient Egypt", "octopuses", "democracy", "gravity",
    "a small bakery", "a rainy city", "a lost dog", "a lighthouse keeper", "a space station",
    "a school garden", "a mountain village", "a robot that learns to paint", "a night train",
    "a football match", "public libraries", "remote work", "healthy breakfasts", "time zones",
)
CONCEPTS = (
    "inflation", "compound interest", "recursion", "natural selection", "supply and demand",
    "the Pythagorean theorem", "entropy", "a hash table", "photosynthesis", "plate tectonics",
    "opportunity cost", "the scientific method", "binary numbers", "an API", "a neural network",
    "probability", "the greenhouse effect", "encryption", "DNA replication", "a budget",
    "fractions", "percentages", "the speed of light", "a democracy", "osmosis",
)
ROLES = (
    "a ship captain", "a medieval knight", "a travel guide in Rome", "a chef", "a detective",
    "a museum curator", "a personal trainer", "an astronaut", "a kindergarten teacher",
    "a customer support agent", "a park ranger", "a journalist",
)
LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese")
SENTENCES = (
    "The weather is very nice today, so we are going to the park.",
    "I would like to book a table for two people at eight o'clock.",
    "The library closes early on Sundays.",
    "My brother bought a new bicycle last week.",
    "Please send me the report before Friday.",
    "We visited the old castle near the river.",
    "The children are playing in the garden.",
    "Could you tell me where the train station is?",
    "She has been learning to play the piano for three years.",
    "The meeting was moved to next Tuesday afternoon.",
    "This soup needs a little more salt.",
    "He forgot his umbrella at the office.",
)
PASSAGES = (
    "The town council met on Monday to discuss the new bus routes. Residents complained that "
    "the current buses are often late and crowded in the morning. The council agreed to add "
    "two extra buses during rush hour and to publish a new timetable next month. Some members "
    "also proposed a cheaper monthly pass for students and older people.",
    "Maria opened her bakery ten years ago with a single oven and a small loan from her family. "
    "At first she sold only bread, but customers kept asking for cakes. Today the bakery employs "
    "twelve people and delivers to three cafes in the city. Maria still arrives at four in the "
    "morning to prepare the dough herself.",
    "Researchers studied how much sleep teenagers get during the school year. They found that "
    "most students slept less than seven hours on school nights, and that those who slept more "
    "reported better concentration and mood. The researchers suggest starting school later and "
    "limiting screen time before bed.",
    "The new museum wing displays tools, pottery and jewellery found during excavations near the "
    "coast. The objects are about two thousand years old and show that the area was an important "
    "trading port. Visitors can also watch a short film about how archaeologists work.",
    "A local football club has started a free training program for children aged eight to "
    "twelve. Sessions take place every Saturday morning and focus on teamwork, fitness and fair "
    "play. The club hopes the program will help children stay active and make new friends.",
    "The company reported that its sales grew by fifteen percent last year, mainly thanks to its "
    "online shop. However, costs also increased because of higher shipping prices. The managers "
    "plan to open a second warehouse to deliver orders faster and reduce transport costs.",
    "Honey bees communicate the location of flowers through a movement called the waggle dance. "
    "The direction of the dance shows the direction of the food relative to the sun, and the "
    "length of the dance shows the distance. Other bees watch the dance and then fly to the "
    "flowers.",
    "During the storm, strong winds knocked down several trees and power lines. Around five "
    "thousand homes lost electricity for most of the night. Repair teams worked until the "
    "morning, and by noon almost all homes had power again. Officials asked people to avoid "
    "fallen cables.",
)

TEMPLATES = (
    ("explain", "Explain {concept} in simple terms."),
    ("explain", "What is {concept}? Give an example."),
    ("write", "Write a short story about {topic}."),
    ("write", "Write a short poem about {topic}."),
    ("write", "Write a blog post introduction about {topic}."),
    ("write", "Write an email to a friend about {topic}."),
    ("qa", "What are three interesting facts about {topic}?"),
    ("qa", "Give me five tips related to {topic}."),
    ("qa", "What are the advantages and disadvantages of {topic}?"),
    ("roleplay", "Pretend you are {role}. Describe a typical day at work."),
    ("roleplay", "You are {role}. Introduce yourself to a group of visitors."),
    ("translate", "Translate the following sentence into {language}: {sentence}"),
    ("translate", "Translate to {language}:\n{sentence}"),
    ("summarize", "Summarize the following text in two sentences.\n\n{passage}"),
    ("summarize", "Read the text and give a one-sentence summary.\n\n{passage}"),
    ("rag", "Use the passage to answer the question.\n\nPassage: {passage}\n\nQuestion: What is the main point of the passage?"),
    ("rag", "{passage}\n\nBased on the text above, list the key facts."),
    ("rewrite", "Rewrite this sentence to sound more formal: {sentence}"),
    ("rewrite", "Make a bulleted list of the main ideas in this text:\n{passage}"),
)


def gsm8k_file(path: str | Path | None) -> Path:
    """``path`` checked: the GSM8K train questions that generated training data starts from
    (not shipped with verispec; ValueError naming ``--gsm8k`` when missing)."""
    if path is None:
        raise ValueError("generating training data needs the GSM8K train questions: pass --gsm8k <train.jsonl> "
                         "(github.com/openai/grade-school-math, grade_school_math/data/train.jsonl)")
    if not Path(path).is_file():
        raise ValueError(f"--gsm8k {path} is not a file")
    return Path(path)


def read_gsm8k_questions(path: str | Path, limit: int | None = None) -> list[str]:
    """GSM8K train questions (one JSON object per line with a ``question`` field)."""
    out = []
    with open(path) as f:
        for line in f:
            out.append(json.loads(line)["question"])
            if limit is not None and len(out) >= limit:
                break
    return out


def read_gsm8k_pairs(path: str | Path, limit: int | None = None) -> list[tuple[str, str]]:
    """(question, reference answer) pairs, for teacher-forced data without generation."""
    out = []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            out.append((row["question"], row["answer"]))
            if limit is not None and len(out) >= limit:
                break
    return out


def make_instruction(rng: random.Random) -> tuple[str, str]:
    """One (kind, instruction) drawn from the templates with ``rng``."""
    kind, template = rng.choice(TEMPLATES)
    text = template.format(
        topic=rng.choice(TOPICS), concept=rng.choice(CONCEPTS), role=rng.choice(ROLES),
        language=rng.choice(LANGUAGES), sentence=rng.choice(SENTENCES), passage=rng.choice(PASSAGES),
    )
    return kind, text


def build_prompts(gsm8k_questions: list[str], n_instructions: int, seed: int = 0) -> list[dict]:
    """Interleaved prompt records ``{"id", "source", "content"}`` (deduplicated, seeded)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    records = []
    for i, q in enumerate(gsm8k_questions):
        records.append({"id": f"gsm8k-{i}", "source": "gsm8k", "content": q})
        seen.add(q)
    tries = 0
    while sum(r["source"] != "gsm8k" for r in records) < n_instructions and tries < 50 * n_instructions + 50:
        tries += 1
        kind, text = make_instruction(rng)
        if text not in seen:
            seen.add(text)
            records.append({"id": f"inst-{len(records)}", "source": kind, "content": text})
    rng.shuffle(records)
    return records
