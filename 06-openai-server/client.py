"""An ordinary OpenAI program: nothing in it knows about this course.

Point it at chapter 06 by changing only the base URL:

    python 06-openai-server/server.py --api-key sk-course &
    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=sk-course \\
        python 06-openai-server/client.py

With no OPENAI_BASE_URL it talks to the local server on port 8000.
"""
import os

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
                api_key=os.environ.get("OPENAI_API_KEY", "none"))
model = client.models.list().data[0].id
print(f"model: {model}\n")

# 1. A chat completion.
answer = client.chat.completions.create(
    model=model, temperature=0, max_tokens=64,
    messages=[{"role": "system", "content": "You are a concise assistant."},
              {"role": "user", "content": "What is the capital of France?"}])
print("chat:", answer.choices[0].message.content)
print("usage:", answer.usage, "\n")

# 2. The same API, streamed: tokens print as the server produces them.
print("stream: ", end="", flush=True)
stream = client.chat.completions.create(
    model=model, max_tokens=96, temperature=0.7, seed=42, stream=True,
    stream_options={"include_usage": True},
    messages=[{"role": "user", "content": "Write a haiku about the sea."}])
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
    if chunk.usage:
        print(f"\n({chunk.usage.completion_tokens} tokens)\n")

# 3. A plain text completion, stopped at the first full stop.
text = client.completions.create(model=model, prompt="The three primary colors are",
                                 max_tokens=32, temperature=0, stop=["."])
print("completion: The three primary colors are" + text.choices[0].text + ".")
