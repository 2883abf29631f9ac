import { defineConfig } from "vite";

// The app embeds dist/ (src-tauri/tauri.conf.json: frontendDist). No inline scripts or styles
// (the CSP allows only the app's own files).
export default defineConfig({
  build: { outDir: "dist", emptyOutDir: true, target: "es2022", assetsInlineLimit: 0 },
  test: { environment: "jsdom", include: ["tests/**/*.test.js"], setupFiles: ["tests/setup.js"] },
});
