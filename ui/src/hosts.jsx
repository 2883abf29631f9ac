// Settings → Hosts: the machines a model could be divided over (the settings' `hosts`, as
// `perch serve --hosts` takes them), each one's memory read over ssh when asked (`check_hosts`,
// which reads the saved list), and each one's share of a divided model. The last reading also
// judges models in the Models view against the group ("fits your hosts").

import { useEffect, useState } from "preact/hooks";
import { ErrorMessage } from "./error-message.jsx";
import { decimalBytes } from "./format.js";

/** The command that serves a model over these hosts (docs/cli.md). */
export function serveCommand(hosts) {
  return `perch serve --model MODEL --distributed tensor --hosts ${hosts.join(",")}`;
}

/** "50%": a machine's share of a model's weights. */
function percent(share) {
  return `${Math.round(share * 100)}%`;
}

/**
 * The last reading of the saved hosts (`hostsStatus`) and a button that reads them again
 * (`checkHosts`). `saved` is the saved list: a new one is read afresh.
 */
export function HostsReading({ api, saved }) {
  const [reading, setReading] = useState(null);
  const [busy, setBusy] = useState(false);
  const [failure, setFailure] = useState(null);
  const key = (saved ?? []).join(",");
  useEffect(() => {
    setReading(null);
    setFailure(null);
    api.hostsStatus?.().then(setReading, () => {});
  }, [api, key]);
  if (!saved || saved.length === 0) {
    return <p class="wide hint" id="hosts-reading">No hosts: models are judged against this machine alone.</p>;
  }
  async function check() {
    setBusy(true);
    setFailure(null);
    try {
      setReading(await api.checkHosts());
    } catch (error) {
      setFailure(error);
    } finally {
      setBusy(false);
    }
  }
  return (
    <div class="wide" id="hosts-reading">
      <button type="button" id="hosts-check" disabled={busy} onClick={check}>
        {busy ? "Reading their memory…" : "Read the hosts' memory"}
      </button>
      {failure && <ErrorMessage error={failure} />}
      {reading && (
        <table class="hosts">
          <caption>{`${reading.machines.length} machine${reading.machines.length === 1 ? "" : "s"}, ${
            reading.memory_bytes == null ? "memory not known for all" : `${decimalBytes(reading.memory_bytes)} of memory together`
          }`}</caption>
          <thead>
            <tr><th scope="col">Host</th><th scope="col">Ranks</th><th scope="col">Memory</th><th scope="col">Share of a model</th></tr>
          </thead>
          <tbody>
            {reading.machines.map((machine) => (
              <tr key={machine.login}>
                <th scope="row">{machine.login}</th>
                <td>{machine.ranks}</td>
                <td>{machine.memory_bytes == null ? <span class="error">{machine.error}</span> : decimalBytes(machine.memory_bytes)}</td>
                <td>{percent(machine.share)}</td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
      <p class="hint">Serve a model over them: <code>{serveCommand(saved)}</code></p>
    </div>
  );
}
