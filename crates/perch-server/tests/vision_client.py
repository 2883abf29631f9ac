"""The official OpenAI and Anthropic Python SDKs sending an image to `perch serve`: prints one JSON
object of what they saw.

    python vision_client.py BASE_URL API_KEY MODEL PNG_FILE
"""
import base64
import json
import sys

import anthropic
import openai

base_url, key, model, png = sys.argv[1:5]
data = base64.b64encode(open(png, "rb").read()).decode()
out = {}

client = openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0)
out["models"] = [m.model_dump() for m in client.models.list().data]
messages = [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
    {"type": "text", "text": "What is this?"},
]}]
plain = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
out["openai"] = {"content": plain.choices[0].message.content, "usage": plain.usage.model_dump()}
pieces = []
for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                            stream=True):
    for choice in chunk.choices:
        pieces.append(choice.delta.content or "")
out["openai_stream"] = "".join(pieces)
for name, url in [("remote", "https://example.com/cat.png"), ("damaged", "data:image/png;base64,iVBORw0KGgo=")]:
    try:
        client.chat.completions.create(model=model, max_tokens=6, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Hi"}]}])
        out[name] = None
    except openai.BadRequestError as e:
        out[name] = {"status": e.status_code, "message": e.message}

claude = anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0)
reply = claude.messages.create(model=model, max_tokens=6, extra_body={"temperature": 0}, messages=[{"role": "user", "content": [
    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
    {"type": "text", "text": "What is this?"},
]}])
out["anthropic"] = {"content": reply.content[0].text, "usage": reply.usage.model_dump()}
print(json.dumps(out))
