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
});
