import { describe, expect, it, vi } from "vitest";
import { markdownToHtml, renderMarkdown } from "../src/markdown.js";

describe("markdown", () => {
  it("renders emphasis, lists and fenced code", () => {
    const html = markdownToHtml("**bold**\n\n- one\n- two\n\n```rust\nfn main() {}\n```");
    expect(html).toContain("<strong>bold</strong>");
    expect(html).toContain("<li>one</li>");
    expect(html).toMatch(/<pre><code class="language-rust">fn main\(\) \{\}\n<\/code><\/pre>/);
  });

  it("removes scripts, event handlers, styles and links' targets from model output", () => {
    const html = markdownToHtml(
      '<script>alert(1)</script><img src=x onerror="alert(2)"><b onclick="x()" style="color:red">hi</b>\n\n' +
        "[site](https://example.com) and [bad](javascript:alert(3)) and <a href=\"javascript:alert(4)\">raw</a>",
    );
    expect(html).not.toMatch(/<script|onerror|onclick|style=|<img|href/);
    expect(html).toContain("<b>hi</b>");
    // Links stay readable (the address in the title) but cannot navigate the web view.
    expect(html).toContain('<a title="https://example.com">site</a>');
    expect(html).toContain(">raw</a>");
  });

  it("puts a copy button on code blocks that copies the code", async () => {
    const writeText = vi.fn().mockResolvedValue(undefined);
    Object.defineProperty(window.navigator, "clipboard", { value: { writeText }, configurable: true });
    const element = document.createElement("div");
    document.body.append(element);
    renderMarkdown(element, "Try:\n\n```\nlet x = 1;\n```\n\nand\n\n```\ny()\n```");
    const buttons = element.querySelectorAll(".code-block > button.copy");
    expect(buttons.length).toBe(2);
    buttons[0].click();
    await vi.waitFor(() => expect(writeText).toHaveBeenCalledWith("let x = 1;\n"));
    await vi.waitFor(() => expect(buttons[0].textContent).toBe("Copied"));
  });

  it("highlights code in the languages it knows, and leaves the rest plain", () => {
    const element = document.createElement("div");
    renderMarkdown(element, "```python\ndef f(x):\n    return \"<b>\" # hi\n```\n\n```brainfuck\n+[-]\n```\n\n```\nplain\n```");
    const [python, unknown, none] = element.querySelectorAll("pre code");
    expect(python.classList.contains("hljs")).toBe(true);
    expect(python.querySelector(".hljs-keyword").textContent).toBe("def");
    expect(python.querySelector(".hljs-string").textContent).toBe('"<b>"');
    expect(python.querySelector(".hljs-comment").textContent).toBe("# hi");
    // The text is unchanged (the copy button copies it) and the model's markup stays text.
    expect(python.textContent).toBe('def f(x):\n    return "<b>" # hi\n');
    expect(python.querySelector("b")).toBe(null);
    expect(unknown.innerHTML).toBe("+[-]\n");
    expect(none.classList.contains("hljs")).toBe(false);
  });
});
