"""English text the tiny tokenizer is trained on and the tiny model's word chain is planted from.

Written for this project. It covers the words our canary and benchmark prompts use (counting,
hash maps, clusters) so chat text tokenizes into whole words rather than bytes.
"""
from __future__ import annotations

TRAINING_TEXT = """\
The cluster has two small machines that work together as one server. Each machine holds half of the
model and they talk to each other over a fast network link. When a request arrives, the head machine
reads the prompt, splits the work, and sends a message to the worker. The worker answers quickly and
the head writes the next word back to the user.

Hello! How are you today? I am fine, thank you. What would you like to talk about? We can talk about
the weather, about cooking, about numbers, or about how computers store data. Please ask a question
and I will try to give a short and clear answer.

A hash map is a data structure that stores pairs of keys and values. It uses a hash function to turn
each key into a number, and that number picks a bucket in an array. To find a value, you hash the key
again and look in the same bucket. When two keys land in the same bucket, the map keeps a short list
or probes the next free slot. A good hash function spreads keys evenly, so most lookups take constant
time. When the table becomes too full, the map grows the array and moves every entry to a new bucket.

Let us count from one to twenty: one, two, three, four, five, six, seven, eight, nine, ten, eleven,
twelve, thirteen, fourteen, fifteen, sixteen, seventeen, eighteen, nineteen, twenty. Now count with
digits: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25,
30, 40, 50, 60, 70, 80, 90, 100, 101, 150, 199, 200.

The morning was cold and bright. A light wind moved across the hills, and the river was quiet. People
walked to the market to buy bread, apples, rice, and fresh green tea. In the evening the sky turned
red, then dark blue, and the first stars appeared above the old stone bridge.

To cook a simple soup, wash the vegetables, cut them into small pieces, and put them in a pot with
water and a little salt. Let the soup boil for ten minutes, then turn the heat down and wait. Taste it
before you serve it, and add pepper if you like.

The system checks every file before it starts. It compares the size of each file with the list it
downloaded, and it writes a marker when everything matches. If a file is missing or too short, the
system fetches it again. This makes a second start fast, because nothing needs to move twice.

Thinking step by step helps with hard problems. First, read the question carefully. Second, write
down what you know. Third, choose a method and try it. Finally, check the answer and explain why it
is right. Good answers are short, honest, and easy to follow.
"""


def known_word_fraction(reply: str) -> float:
    """Share of the reply's words that occur in TRAINING_TEXT: a canary test for the tiny model.

    Exact text differs between engines (bf16 vs fp32, compiled vs eager kernels break near-ties
    differently), but every token the planted chain can produce is a word of this text, so a healthy
    engine scores close to 1.0 while a broken one (garbage ids, byte soup, empty reply) does not.
    """
    vocabulary = {w.strip(".,!?:;").lower() for w in TRAINING_TEXT.split()}
    words = [w.strip(".,!?:;").lower() for w in reply.split() if w.strip(".,!?:;")]
    if not words:
        return 0.0

    # Dropped whitespace tokens glue neighbours ("followThe"); count a glued pair as known if both parts are.
    def known(word: str) -> bool:
        return word in vocabulary or any(
            word[:i] in vocabulary and word[i:] in vocabulary for i in range(1, len(word))
        )
    return sum(known(w) for w in words) / len(words)
