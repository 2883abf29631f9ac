import { defineConfig } from "vite";

// The app embeds dist/ (src-tauri/tauri.conf.json: frontendDist). No inline scripts or styles
// (the CSP allows only the app's own files). Components are Preact, written in JSX (.jsx files)
// that Vite's esbuild compiles to preact's `jsx` calls.
export default defineConfig({
  esbuild: { jsx: "automatic", jsxImportSource: "preact" },
  build: { outDir: "dist", emptyOutDir: true, target: "es2022", assetsInlineLimit: 0 },
  test: { environment: "jsdom", include: ["tests/**/*.test.{js,jsx}"], setupFiles: ["tests/setup.js"] },
});
