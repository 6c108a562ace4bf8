#!/usr/bin/env python3
"""Builds crates/ferrolm-tokenizer/tests/golden/corpus.json: the strings every tokenizer test runs.

Deterministic (fixed seed); rerun only to change the corpus, then rerun tokenizer_golden.py.
"""
import json
import os
import random

rng = random.Random(20261130)
C = []

# English prose
C += [
    "Hello world",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "It's a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.",
    "I'm sure you'll agree: they've done what we'd expect, and he's right.",
    "DON'T SHOUT! I'M LISTENING. WE'LL SEE. THEY'RE HERE. YOU'VE GOT IT. SHE'D KNOW.",
    "Mr. Smith went to Washington D.C. on Jan. 5th, 2021 (a Tuesday).",
    "\"Quoted text,\" she said, 'and single quotes' too.",
    "Once upon a time, in a land far, far away, there lived a king who had three daughters. The youngest was the most beautiful of all.",
    "Machine learning models are trained on large datasets; their performance depends on data quality, model size, and compute.",
    "e.g. i.e. etc. vs. a.m. p.m.",
    "hello", "Hello", "HELLO", "hElLo", " hello", "  hello", "hello ", "hello  ",
    "a", "A", "I", " a", "a ", "ab", "abc",
    "supercalifragilisticexpialidocious",
    "antidisestablishmentarianism pneumonoultramicroscopicsilicovolcanoconiosis",
    "The year 1984 was followed by 1985.",
    "Call me at 555-123-4567 or email john.doe@example.com.",
    "Visit https://www.example.com/path?query=value&x=1#anchor for more.",
    "Price: $19.99 (20% off!) — only today.",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore et dolore magna aliqua.",
    "What's the weather like today? It's sunny, isn't it?",
    "'s 't 're 've 'm 'll 'd",
    "'S 'T 'RE 'VE 'M 'LL 'D",
    "rock'n'roll o'clock y'all ma'am",
    "the end.", "The End", "THE END",
]
prose = ("In the beginning the Universe was created. This has made a lot of people very angry "
         "and been widely regarded as a bad move. Many were increasingly of the opinion that "
         "they'd all made a big mistake in coming down from the trees in the first place.")
C.append(prose)
C.append(prose + "\n\n" + prose.upper() + "\n" + prose.lower())

# code
C += [
    "def main():\n    print(\"hello\")\n\nif __name__ == \"__main__\":\n    main()\n",
    "fn main() {\n    let x: Vec<u32> = (0..10).map(|i| i * 2).collect();\n    println!(\"{:?}\", x);\n}\n",
    "#include <stdio.h>\nint main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "function add(a, b) { return a + b; }\nconst x = add(1, 2); // 3\n",
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%son' ORDER BY id DESC;",
    "<html>\n  <body>\n    <div class=\"main\">Hello &amp; welcome</div>\n  </body>\n</html>",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null, \"b\": true, \"c\": 3.14}}",
    "package main\n\nimport \"fmt\"\n\nfunc main() {\n\tfmt.Println(\"hi\")\n}\n",
    "public class Foo {\n    private int x = 0;\n    public int getX() { return this.x; }\n}\n",
    "x = [i**2 for i in range(10) if i % 2 == 0]",
    "a+=1;b-=2;c*=3;d/=4;e%=5;f<<=1;g>>=2;h&=3;i|=4;j^=5;",
    "if (a != b && c == d || !e) { x->y = z::w; }",
    "#!/bin/bash\nfor f in *.txt; do\n  echo \"$f\" | tr 'a-z' 'A-Z' > \"${f%.txt}.out\"\ndone\n",
    "    indented with four spaces\n        and eight\n\t\tand two tabs",
    "let s = r#\"raw string\"#; let c = '\\u{1F600}';",
    "// comment\n/* block\n   comment */\n",
    "$x = @array[0..$#array]; %hash = (a => 1);",
    "```python\nprint('hi')\n```",
    "snake_case camelCase PascalCase SCREAMING_CASE kebab-case",
    "i++ ++i i-- --i a->b a=>b a::b a..b a...b a?.b a??b",
    "0x1F 0b1010 0o777 1e10 1.5e-3 3.14159 -42 +7",
    "\\n \\t \\\\ \\\" \\'",
]

# whitespace
for n in range(1, 11):
    C.append(" " * n)
    C.append("a" + " " * n + "b")
for s in ["\t", "\t\t", "\n", "\n\n", "\n\n\n", "\r\n", "\r\n\r\n", "\r", " \n", "\n ", " \n ", "\t\n",
          "  \n  \n", "a\tb", "a\t\tb", "a\nb", "a\n\nb", "a \n b", "a  \n\n  b", "\n\n\nx",
          "x\n\n\n", "  x  ", "\t x \t", " \t \n \r\n ", "line1\nline2\r\nline3\rline4",
          "\u00a0", "a\u00a0b", "a\u2003b", "a\u3000b", "\u2028\u2029", "a\u200bb", "\u000b\u000c",
          "trailing spaces   ", "   leading spaces", "many     inner     spaces"]:
    C.append(s)

# numbers of every length
digits = "31415926535897932384626433832795028841971"
for n in range(1, 26):
    C.append(digits[:n])
for n in range(1, 13):
    C.append("x " + digits[:n] + " y")
C += ["1,000,000", "1.000.000,50", "3.14", "-0.5", "1/2", "10:30", "2024-01-15", "+1 (555) 010-9999",
      "v1.2.3", "1st 2nd 3rd 4th", "١٢٣٤٥", "一二三", "½ ¾ ⅓", "①②③", "Ⅻ", "٣.١٤", "१२३"]

# punctuation
C += ["!", "?", ".", ",", "...", "?!", "!!!", "???", "—", "–", "…", "«»", "“quotes”", "‘single’",
      "(parens)", "[brackets]", "{braces}", "<angle>", "a.b,c;d:e!f?g", "@#$%^&*()_+-=[]{}|;':\",./<>?`~",
      "!@#$%^&*()", "--", "---", "***", "___", "===", "~~~", "###", "##", "#", " - ", " -- ", "a - b",
      "...and then?", "Wait... what?!", "¡Hola! ¿Qué tal?"]

# accented Latin and other European scripts
C += ["café", "naïve", "résumé", "Crème brûlée", "façade", "jalapeño", "Zürich", "Øresund", "Ångström",
      "Łódź", "Dvořák", "İstanbul", "straße", "ß", "Ægir", "œuvre", "São Paulo", "ﬁnancial ﬂow",
      "e\u0301", "n\u0303", "A\u030a", "Ελληνικά γράμματα", "Привет, мир!", "Съешь же ещё этих мягких французских булок",
      "Україна", "Հայերեն", "ქართული", "Tiếng Việt có dấu", "Bahasa Indonesia", "Kiswahili"]

# CJK and other Asian scripts
C += ["你好", "你好，世界！", "我爱北京天安门。", "中文测试：这是一段较长的中文文本，用于测试分词器。",
      "日本語のテキスト", "こんにちは世界", "カタカナ", "ひらがな", "東京都渋谷区", "한국어", "안녕하세요 세계",
      "ภาษาไทย", "हिन्दी भाषा", "বাংলা", "தமிழ்", "ગુજરાતી", "漢字かなカナ混じり文", "中a文b混c合",
      "汉字123汉字", "ＡＢＣ全角", "ｶﾀｶﾅ", "𠀋𠀍𠀎", "龘"]

# emoji
C += ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷🇯🇵", "❤️", "I ❤️ NY", "🤖 robots 🤖", "🔥🔥🔥", "emoji😀inside",
      "✅ done", "⭐️⭐️⭐️", "🏳️‍🌈", "😀 😃 😄 😁", "a😀b😃c", "🎉🎊🎈", "🧑🏻‍💻"]

# RTL
C += ["مرحبا بالعالم", "العربية", "السلام عليكم ورحمة الله", "שלום עולם", "עברית", "English עברית mixed",
      "عربي123", "\u202eRTL override\u202c", "فارسی", "اردو"]

# odd sequences
C += ["\u0000", "a\u0000b", "\u0001\u0002\u0003", "\u007f", "\ufeffBOM", "\ufffd", "\uffff",
      "\U0001f600\U0001f600", "\U000e0041", "\U0010ffff", "\ue000", "Zalgo: Z\u0336\u0351a\u0337l\u0338g\u0334o\u0335",
      "▁", "▁▁", "a▁b", "Ġ", "Ċ", "ĠĠ", "<0x0A>", "<0xFF>", "<0x41>", "Ã©", "â€™", "\\x00", "%00",
      "a" * 50, "ab" * 30, " " * 40, "\n" * 20, "." * 30, "0" * 30, "é" * 20, "😀" * 10,
      "‍", "a‍b", "\u200d\u200d", "\u0300", " \u0300", "\u0301abc"]

# special-token text (both models' specials, and look-alikes)
C += ["<|im_start|>", "<|im_end|>", "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
      "<|im_start|>system\nYou are helpful.<|im_end|>", "<|endoftext|>", "text<|endoftext|>more",
      "<start_of_turn>", "<end_of_turn>", "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
      "<bos>", "<eos>", "<pad>", "<unk>", "<mask>", "<bos>Hello", "Hello<eos>", " <bos> ", "<bos><bos>",
      "<start_of_image>", "<end_of_image>", "<unused0>", "<unused99>", "<|im_start", "im_start|>",
      "<<|im_end|>>", "<|im_end|><|im_end|>", "<|im_start|><|im_start|>user", "< |im_start| >",
      "<s>", "</s>", "<|endoftext|><|im_start|>", "<repo_name>", "<file_sep>", "<filename>",
      "<start_of_turn>model\n<end_of_turn><eos>", "abc<end_of_turn>def", "<start_of_turn><start_of_turn>",
      "[INST] hi [/INST]", "<|user|>", "<|assistant|>", "<think>reasoning</think>", "<tool_call>{}</tool_call>"]

# mixed, realistic chat-like content
C += ["User: What is 2+2?\nAssistant: 2+2 = 4.", "Q: Why?\nA: Because.", "1. First\n2. Second\n3. Third",
      "- item one\n- item two\n  - nested", "| a | b |\n|---|---|\n| 1 | 2 |", "**bold** _italic_ `code`",
      "# Title\n\n## Subtitle\n\nParagraph text.", "> quoted line\n>> nested quote",
      "Temperature: 23°C (73°F)", "E = mc²", "H₂O", "x² + y² = z²", "∑∀∃∈∉⊂⊃∩∪", "→ ← ↑ ↓ ⇒ ⇔", "α β γ δ ε",
      "© ® ™ § ¶ † ‡ • ‰", "€100 £50 ¥1000 ₹500 ₿1", "Ω≈ç√∫˜µ≤≥÷"]

# pseudo-random mixtures, fixed seed
alphabet = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \n\t.,;:!?'\"()-_/\\@#$%&*+=<>[]{}|~`") + \
    list("éüñçøåß") + list("你好世界日本語한국") + ["😀", "👍", "🇫🇷", "\u0301", "\u00a0", "▁", "<|im_end|>", "<bos>", "<end_of_turn>"]
while len(C) < 330:
    n = rng.randint(1, 40)
    C.append("".join(rng.choice(alphabet) for _ in range(n)))

seen = set()
corpus = []
for s in C:
    if s not in seen:
        seen.add(s)
        corpus.append(s)

out = os.path.join(os.path.dirname(__file__), "..", "crates", "ferrolm-tokenizer", "tests", "golden", "corpus.json")
with open(out, "w", encoding="utf-8") as f:
    json.dump(corpus, f, ensure_ascii=False, indent=0)
    f.write("\n")
print(len(corpus), "strings ->", os.path.normpath(out))
