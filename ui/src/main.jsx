// The web view's entry: draws the app (src/app.jsx) into the page's body, wired to the Rust
// commands.

import "./locale.js"; // first: before uPlot reads the locale
import "./style.css";
import { render } from "preact";
import { api } from "./api.js";
import { App } from "./app.jsx";

render(<App api={api} storage={window.localStorage} />, document.body);
