"""The synthetic corpus the tiny model is trained on, generated from a seed.

Four kinds of documents: plain English and Chinese prose (facts and sentences the model
learns to continue), chats (questions and answers, with and without a <think> block),
tool chats (a matching tool offered -> a Qwen3 <tool_call>; a tool's result -> an answer
that uses it) and chats where the offered tools do not fit (a plain answer). A chat is a
message list for the chat template plus the assistant turn the model must learn to write.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

# (English country, capital, Chinese country, capital)
COUNTRIES = [
    ("France", "Paris", "法国", "巴黎"), ("Japan", "Tokyo", "日本", "东京"), ("China", "Beijing", "中国", "北京"),
    ("Germany", "Berlin", "德国", "柏林"), ("Italy", "Rome", "意大利", "罗马"), ("Spain", "Madrid", "西班牙", "马德里"),
    ("England", "London", "英国", "伦敦"), ("Russia", "Moscow", "俄罗斯", "莫斯科"), ("Egypt", "Cairo", "埃及", "开罗"),
    ("Canada", "Ottawa", "加拿大", "渥太华"), ("Australia", "Canberra", "澳大利亚", "堪培拉"),
    ("India", "New Delhi", "印度", "新德里"), ("Korea", "Seoul", "韩国", "首尔"), ("Greece", "Athens", "希腊", "雅典"),
    ("Thailand", "Bangkok", "泰国", "曼谷"), ("Mexico", "Mexico City", "墨西哥", "墨西哥城"),
]
CITIES = [c[1] for c in COUNTRIES] + ["Shanghai", "New York", "Sydney", "Hangzhou", "Chicago", "Toronto"]
CONDITIONS = [("sunny", "晴"), ("cloudy", "多云"), ("rainy", "有雨"), ("snowy", "有雪"), ("windy", "有风")]
CURRENCIES = ["USD", "EUR", "CNY", "JPY", "GBP"]
TOPICS = ["the history of Rome", "paged attention", "the tallest mountain", "Python tutorials",
          "news about Ray", "the Great Wall", "how to bake bread", "the speed of light"]
PEOPLE = ["alice@example.com", "bob@example.com", "carol@example.com", "dave@example.com"]
SUBJECTS = ["the meeting", "lunch tomorrow", "the weekly report", "the new project", "holiday plans"]


def _tool(name: str, description: str, params: dict, required: list[str]) -> dict:
    props = {k: {"type": t} for k, (t, _) in params.items()}  # short: the prompt is most of the compute
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": required}}}


TOOLS = {
    "get_weather": _tool("get_weather", "Get the current weather in a city.",
                         {"city": ("string", "The name of the city.")}, ["city"]),
    "get_time": _tool("get_time", "Get the current local time in a city.",
                      {"city": ("string", "The name of the city.")}, ["city"]),
    "convert_currency": _tool("convert_currency", "Convert an amount of money from one currency to another.",
                              {"amount": ("number", "The amount to convert."),
                               "from_currency": ("string", "The currency code to convert from."),
                               "to_currency": ("string", "The currency code to convert to.")},
                              ["amount", "from_currency", "to_currency"]),
    "search_web": _tool("search_web", "Search the web and return the top results.",
                        {"query": ("string", "What to search for.")}, ["query"]),
    "send_email": _tool("send_email", "Send a short email.",
                        {"to": ("string", "The address to send to."), "subject": ("string", "The subject line.")},
                        ["to", "subject"]),
}

ENGLISH = [
    "The quick brown fox jumps over the lazy dog.", "A journey of a thousand miles begins with a single step.",
    "Ray schedules tasks and actors across a cluster of machines.", "Each worker owns one accelerator.",
    "The scheduler batches prefill chunks and decode rows into one step.",
    "Paged attention stores keys and values in fixed-size blocks.", "Hello, world! How are you today?",
    "Once upon a time there was a small model that wanted to write poems about the sea and the stars.",
    "Large language models predict the next token given the previous tokens.",
    "Water boils at one hundred degrees Celsius at sea level.", "Ice melts at zero degrees.",
    "Spring brings flowers, summer brings heat, autumn brings falling leaves and winter brings snow.",
    "The library opens at nine in the morning and closes at six in the evening.",
    "Mathematics studies numbers, shapes and patterns; physics studies matter and energy.",
    "Please remember to water the plants, feed the cat and lock the door.",
    "Mountains, rivers, forests, deserts and oceans cover the surface of our planet.",
    "Breakfast was bread with butter, eggs, orange juice and a cup of coffee.",
    "Children learn to read, write, count, draw and sing in the village school.",
    "Yesterday we visited the museum, walked along the river and watched the sunset.",
    "The sky is blue on a clear day.", "There are seven days in a week and twelve months in a year.",
]
CHINESE = [
    "北京故宫是中国明清两代的皇家宫殿，旧称紫禁城，位于北京中轴线的中心。",
    "北京故宫是世界上现存规模最大、保存最为完整的木质结构古建筑之一。",
    "北京故宫是一座博物馆，每年有很多游客来这里参观。",
    "长城是古代中国为抵御外敌而修筑的军事工程，绵延数千公里。",
    "今天天气很好，我们一起去公园散步吧。", "你好，世界！你今天过得怎么样？",
    "人工智能正在改变我们的生活和工作方式。", "大语言模型可以回答问题、写文章和翻译。",
    "春眠不觉晓，处处闻啼鸟。夜来风雨声，花落知多少。", "床前明月光，疑是地上霜。举头望明月，低头思故乡。",
    "上海是中国最大的城市之一，也是重要的经济和金融中心。", "杭州西湖风景优美，是著名的旅游城市。",
    "黄河是中华民族的母亲河，长江是中国第一大河。", "我喜欢读书、听音乐、看电影，周末常常和朋友一起爬山。",
    "熊猫生活在四川的竹林里，它们每天要吃很多竹子。", "中秋节的时候，家人团聚在一起吃月饼、赏月亮。",
    "秋天到了，树叶变黄了，一片一片地从树上落下来。", "计算机科学包括算法、数据结构、操作系统和网络等课程。",
]
# (question variants, reasoning, answer)
QA_EN = [
    (["Hello!", "Hi there.", "Good morning!", "Hello"], "The user greets me. I should greet them back.",
     "Hello! How can I help you today?"),
    (["Who are you?", "What is your name?"], "The user asks who I am. I am a small test model.",
     "I am a tiny Qwen3 model that raylm uses in its tests."),
    (["What color is the sky?", "Why is the sky blue?"], "The user asks about the sky. The sky looks blue.",
     "The sky is blue on a clear day."),
    (["How many days are in a week?"], "The user asks about a week. A week has seven days.",
     "There are seven days in a week."),
    (["At what temperature does water boil?", "When does water boil?"],
     "The user asks about boiling water. Water boils at one hundred degrees Celsius.",
     "Water boils at one hundred degrees Celsius at sea level."),
    (["Tell me a short story.", "Tell me a story."], "The user wants a story. I will tell a short one.",
     "Once upon a time there was a small model that wanted to write poems about the sea and the stars."),
    (["What is Ray?"], "The user asks about Ray. Ray runs tasks and actors on a cluster.",
     "Ray is a framework that schedules tasks and actors across a cluster of machines."),
    (["What does a language model do?"], "The user asks about language models. They predict tokens.",
     "A language model predicts the next token given the previous tokens."),
    (["Thank you!", "Thanks a lot."], "The user thanks me. I should reply politely.", "You are welcome!"),
]
QA_ZH = [
    (["你好", "你好！", "您好"], "用户在打招呼，我应该礼貌地回应。", "你好！有什么可以帮你的吗？"),
    (["你是谁？", "你叫什么名字？"], "用户问我是谁。我是一个很小的模型。", "我是一个很小的Qwen3模型，用来测试raylm。"),
    (["北京故宫是什么？", "介绍一下北京故宫。"], "用户问北京故宫。故宫是明清两代的皇家宫殿。",
     "北京故宫是中国明清两代的皇家宫殿，旧称紫禁城。"),
    (["介绍一下长城。", "长城是什么？"], "用户问长城。长城是古代的军事工程。",
     "长城是古代中国为抵御外敌而修筑的军事工程，绵延数千公里。"),
    (["谢谢！", "谢谢你。"], "用户在感谢我，我应该客气地回答。", "不客气！"),
]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a tiny assistant. Answer briefly."]


@dataclass
class Chat:
    messages: list[dict]                       # the conversation before the turn to learn
    reasoning: str                             # the think block's text ("" when thinking is off)
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # [{"name": ..., "arguments": {...}}]
    tools: list[dict] | None = None
    enable_thinking: bool = True


def prose(rng: random.Random, chinese_lead: float = 0.3, english: float = 0.5) -> str:
    if rng.random() < english:
        facts = [f"The capital of {c} is {k}." for c, k, _, _ in COUNTRIES]
        weather = [f"Today it is {rng.choice(CONDITIONS)[0]} in {rng.choice(CITIES)}." for _ in range(3)]
        return " ".join(rng.sample(ENGLISH + facts + weather, rng.randint(2, 4)))
    facts = [f"{c}的首都是{k}。" for _, _, c, k in COUNTRIES]
    lead = rng.choice(CHINESE[:3]) if rng.random() < chinese_lead else ""
    return lead + "".join(rng.sample(CHINESE + facts, rng.randint(1, 3)))


def _qa(rng: random.Random) -> tuple[str, str, str]:
    roll = rng.random()
    if roll < 0.25:
        c, k, zc, zk = rng.choice(COUNTRIES)
        if rng.random() < 0.6:
            q = rng.choice([f"What is the capital of {c}?", f"Which city is the capital of {c}?"])
            return q, f"The user asks for the capital of {c}. The capital of {c} is {k}.", f"The capital of {c} is {k}."
        return f"{zc}的首都是哪里？", f"用户问{zc}的首都。{zc}的首都是{zk}。", f"{zc}的首都是{zk}。"
    if roll < 0.4:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return f"What is {a} plus {b}?", f"The user asks for {a} plus {b}. {a} plus {b} is {a + b}.", f"{a} plus {b} is {a + b}."  # noqa: E501
    qs, reasoning, answer = rng.choice(QA_EN if rng.random() < 0.6 else QA_ZH)
    return rng.choice(qs), reasoning, answer


def _system(rng: random.Random) -> list[dict]:
    return [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.3 else []


def _call(rng: random.Random) -> tuple[str, str, list[dict], list[str], str, str]:
    """A request that fits a tool: (question, reasoning, calls, results, answer reasoning, answer)."""
    kind = rng.choice(["get_weather", "get_weather", "get_time", "convert_currency", "search_web", "send_email"])
    if kind == "get_weather" and rng.random() < 0.25:
        a, b = rng.sample(CITIES, 2)
        (ca, _), (cb, _) = rng.choice(CONDITIONS), rng.choice(CONDITIONS)
        ta, tb = rng.randint(-5, 35), rng.randint(-5, 35)
        return (f"What is the weather in {a} and {b}?",
                f"The user wants the weather in {a} and {b}. I will call get_weather for each city.",
                [{"name": "get_weather", "arguments": {"city": a}}, {"name": "get_weather", "arguments": {"city": b}}],
                [json.dumps({"city": a, "condition": ca, "temperature": ta}),
                 json.dumps({"city": b, "condition": cb, "temperature": tb})],
                f"The tools say {a} is {ca} and {b} is {cb}.",
                f"In {a} it is {ca} and {ta} degrees. In {b} it is {cb} and {tb} degrees.")
    if kind == "get_weather":
        city, (cond, _), temp = rng.choice(CITIES), rng.choice(CONDITIONS), rng.randint(-5, 35)
        q = rng.choice([f"What is the weather in {city}?", f"How is the weather in {city} today?",
                        f"Is it cold in {city} now?"])
        return (q, f"The user wants the weather in {city}. I can call get_weather with the city {city}.",
                [{"name": "get_weather", "arguments": {"city": city}}],
                [json.dumps({"city": city, "condition": cond, "temperature": temp})],
                f"The tool says it is {cond} and {temp} degrees in {city}.",
                f"It is {cond} in {city} and the temperature is {temp} degrees.")
    if kind == "get_time":
        city, t = rng.choice(CITIES), f"{rng.randint(0, 23):02d}:{rng.choice(['00', '15', '30', '45'])}"
        return (rng.choice([f"What time is it in {city}?", f"Tell me the time in {city}."]),
                f"The user asks for the time in {city}. I can call get_time with the city {city}.",
                [{"name": "get_time", "arguments": {"city": city}}], [json.dumps({"city": city, "time": t})],
                f"The tool says it is {t} in {city}.", f"It is {t} in {city} now.")
    if kind == "convert_currency":
        amount, (src, dst) = rng.choice([5, 10, 20, 50, 100, 250, 1000]), rng.sample(CURRENCIES, 2)
        result = round(amount * rng.uniform(0.5, 2.0), 2)
        return (rng.choice([f"Convert {amount} {src} to {dst}.", f"How much is {amount} {src} in {dst}?"]),
                f"The user wants to convert {amount} {src} to {dst}. I can call convert_currency.",
                [{"name": "convert_currency", "arguments": {"amount": amount, "from_currency": src, "to_currency": dst}}],  # noqa: E501
                [json.dumps({"amount": result, "currency": dst})],
                f"The tool says {amount} {src} is {result} {dst}.", f"{amount} {src} is {result} {dst}.")
    if kind == "search_web":
        topic = rng.choice(TOPICS)
        return (rng.choice([f"Search the web for {topic}.", f"Can you look up {topic} online?"]),
                f"The user wants a web search about {topic}. I can call search_web.",
                [{"name": "search_web", "arguments": {"query": topic}}],
                [json.dumps({"results": [f"A short article about {topic}."]})],
                f"The search found an article about {topic}.", f"I found a short article about {topic}.")
    to, subject = rng.choice(PEOPLE), rng.choice(SUBJECTS)
    return (f"Send an email to {to} about {subject}.",
            f"The user wants an email sent to {to} about {subject}. I can call send_email.",
            [{"name": "send_email", "arguments": {"to": to, "subject": subject}}], [json.dumps({"status": "sent"})],
            f"The tool says the email was sent to {to}.", f"I sent the email about {subject} to {to}.")


def _offered(rng: random.Random, needed: set[str]) -> list[dict]:
    names = set(needed) | set(rng.sample(sorted(TOOLS), rng.choice([0, 0, 1, 1, 2])))
    names = sorted(names)
    rng.shuffle(names)
    return [TOOLS[n] for n in names]


WORDS = CITIES + TOPICS + SUBJECTS + [c[2] for c in COUNTRIES] + ["red", "blue", "green", "seven", "42", "raylm"]


def repeat(rng: random.Random) -> Chat:
    """A short chat whose answer copies the question: it teaches the model to copy what it reads."""
    phrase = " ".join(rng.sample(WORDS, rng.randint(1, 3)))
    think = rng.random() < 0.3
    q = rng.choice([f"Repeat after me: {phrase}", f"Say {phrase}.", f"请重复：{phrase}"])
    return Chat([{"role": "user", "content": q}], f"The user wants me to say {phrase}." if think else "", phrase,
                enable_thinking=think)


def chat(rng: random.Random) -> Chat:
    think = rng.random() < 0.55
    roll = rng.random()
    if roll < 0.45:  # a plain question, sometimes after an earlier exchange
        history = []
        if rng.random() < 0.2:
            q0, _, a0 = _qa(rng)
            history = [{"role": "user", "content": q0}, {"role": "assistant", "content": a0}]
        q, r, a = _qa(rng)
        tools = _offered(rng, set()) if rng.random() < 0.2 else None
        return Chat(_system(rng) + history + [{"role": "user", "content": q}], r if think else "", a,
                    tools=tools or None, enable_thinking=think)
    q, r, calls, results, r2, answer = _call(rng)
    if roll < 0.52:  # the matching tool is not offered
        return Chat(_system(rng) + [{"role": "user", "content": q}],
                    "The user asks for something I need a tool for, but no tool is offered." if think else "",
                    "I cannot do that without a tool. Please offer me a tool for it.", enable_thinking=think)
    tools = _offered(rng, {c["name"] for c in calls})
    messages = _system(rng) + [{"role": "user", "content": q}]
    if roll < 0.78:
        return Chat(messages, r if think else "", tool_calls=calls, tools=tools, enable_thinking=think)
    asked = {"role": "assistant", "content": "", "reasoning_content": r if think else "",
             "tool_calls": [{"type": "function", "function": c} for c in calls]}
    replies = [{"role": "tool", "content": res} for res in results]
    return Chat(messages + [asked] + replies, r2 if think else "", answer, tools=tools, enable_thinking=think)


def documents(seed: int, n: int) -> list[str | Chat]:
    """n documents: about 30% prose, the rest chats."""
    rng = random.Random(seed)
    return [prose(rng) if rng.random() < 0.3 else chat(rng) for _ in range(n)]


def anneal_documents(seed: int, n: int) -> list[str | Chat]:
    """The second, short phase: more Chinese prose (led by the README's 北京故宫是), chats that
    copy what they read, and the usual chats so nothing is forgotten."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        roll = rng.random()
        docs.append(prose(rng, chinese_lead=0.6, english=0.3) if roll < 0.35 else repeat(rng) if roll < 0.45
                    else chat(rng))
    return docs
