import { describe, expect, it } from "vitest";
import { render } from "@testing-library/preact";
import { Markdown } from "../src/markdown-view.jsx";

describe("Markdown", () => {
  it("renders an answer sanitized, with its code blocks' Copy buttons, and again only when the text changes", () => {
    const { container, rerender } = render(<Markdown text={"**Hi** <img src=x onerror=alert(1)>\n\n```js\nlet a = 1;\n```"} />);
    const body = container.querySelector("div.body");
    expect(body.querySelector("strong").textContent).toBe("Hi");
    expect(body.querySelector("img")).toBe(null);
    expect(body.querySelector("pre code.hljs")).not.toBe(null);
    const copy = body.querySelector(".code-block > button.copy");
    copy.textContent = "Copied"; // as after a click
    rerender(<Markdown text={"**Hi** <img src=x onerror=alert(1)>\n\n```js\nlet a = 1;\n```"} />);
    expect(body.querySelector(".code-block > button.copy")).toBe(copy); // the same text: left alone
    rerender(<Markdown text="Bye" />);
    expect(container.querySelector("div.body")).toBe(body);
    expect(body.textContent.trim()).toBe("Bye");
    expect(body.querySelector("button")).toBe(null);
  });
});
