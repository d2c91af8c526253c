// kvtether for OpenCode: keep a session's KV on the kvtether router's decode instance while
// its tools run, and release it when the session is done. Installed by
// `kvtether hook install opencode` (docs/coding-agents.md); settings from the environment:
// KVTETHER_URL (default http://127.0.0.1:8000), KVTETHER_API_KEY, KVTETHER_HOOK_MAX_LEASE_S.
//
// The router's conversation is OpenCode's session id (its `x-session-id` header); a subagent
// runs in a child session of its own. While a tool runs, from a second into it, the session
// is heartbeated (phase tool_running), at most every 20 s and three times per router lease,
// for at most KVTETHER_HOOK_MAX_LEASE_S (900 s). A subagent's session is released when it goes
// idle (its task is done), every session this process used when it is deleted or when
// OpenCode exits. Nothing here throws into OpenCode: a router that is down or holds no KV
// (404, 410) only ends the heartbeats.

const env = process.env
const ROUTER = (env.KVTETHER_URL || "http://127.0.0.1:8000").trim().replace(/\/+$/, "")
const API_KEY = env.KVTETHER_API_KEY || ""
const MAX_LEASE_S = Number(env.KVTETHER_HOOK_MAX_LEASE_S)
const MAX_LEASE_MS = (MAX_LEASE_S > 0 && Number.isFinite(MAX_LEASE_S) ? MAX_LEASE_S : 900) * 1000
const FIRST_BEAT_MS = 1000 // a shorter tool is covered by the lease of the answer that called it
const MAX_BEAT_INTERVAL_MS = 20000
const MIN_BEAT_INTERVAL_MS = 250
const REQUEST_TIMEOUT_MS = 2000

async function call(method, sessionID, suffix, body) {
  try {
    const headers = { accept: "application/json" }
    if (body) headers["content-type"] = "application/json"
    if (API_KEY) headers.authorization = `Bearer ${API_KEY}`
    const res = await fetch(`${ROUTER}/v1/sessions/${encodeURIComponent(sessionID)}${suffix}`, {
      method,
      headers,
      body: body ? JSON.stringify(body) : undefined,
      signal: AbortSignal.timeout(REQUEST_TIMEOUT_MS),
    })
    const json = await res.json().catch(() => ({}))
    return { status: res.status, body: json && typeof json === "object" ? json : {} }
  } catch {
    return { status: null, body: {} } // refused, timed out
  }
}

export const KVTether = async () => {
  const tools = new Map() // callID -> { sessionID, tool, until, timer }
  const used = new Set() // sessions this process sent model requests or ran tools for
  const parents = new Map() // subagent session -> its parent

  function schedule(callID, delayMs) {
    const t = tools.get(callID)
    if (!t) return
    t.timer = setTimeout(() => beat(callID), delayMs)
    t.timer.unref?.()
  }

  async function beat(callID) {
    const t = tools.get(callID)
    if (!t) return
    if (Date.now() >= t.until) return stop(callID)
    const tool = String(t.tool || "").slice(0, 200)
    const body = tool ? { phase: "tool_running", tool_name: tool } : { phase: "tool_running" }
    const r = await call("POST", t.sessionID, "/heartbeat", body)
    if (tools.get(callID) !== t) return // the tool ended meanwhile
    // The router said no for good (404 unknown, 410 no KV held, ...): asking again cannot help.
    if (r.status !== null && r.status >= 400 && r.status < 500) return stop(callID)
    let interval = MAX_BEAT_INTERVAL_MS
    const remaining = r.body.lease_remaining_s
    if (r.status !== null && r.status < 300 && typeof remaining === "number" && remaining > 0) {
      interval = Math.min(interval, (remaining * 1000) / 3)
    }
    schedule(callID, Math.max(interval, MIN_BEAT_INTERVAL_MS))
  }

  function stop(callID) {
    const t = tools.get(callID)
    if (t) clearTimeout(t.timer)
    tools.delete(callID)
  }

  async function release(sessionID) {
    for (const [callID, t] of tools) if (t.sessionID === sessionID) stop(callID)
    used.delete(sessionID)
    parents.delete(sessionID)
    await call("DELETE", sessionID, "", null)
  }

  const quietly = (fn) => async (...args) => {
    try {
      await fn(...args)
    } catch {
      // never break OpenCode
    }
  }

  return {
    "chat.headers": quietly(async (input) => {
      if (input?.sessionID) used.add(input.sessionID)
    }),
    "tool.execute.before": quietly(async (input) => {
      if (!input?.sessionID || !input.callID) return
      used.add(input.sessionID)
      stop(input.callID)
      const until = Date.now() + MAX_LEASE_MS
      tools.set(input.callID, { sessionID: input.sessionID, tool: input.tool, until, timer: null })
      schedule(input.callID, FIRST_BEAT_MS)
    }),
    "tool.execute.after": quietly(async (input) => {
      if (input?.callID) stop(input.callID)
    }),
    event: quietly(async ({ event }) => {
      const props = event?.properties || {}
      if (event?.type === "session.created" && props.info?.parentID) {
        parents.set(props.info.id, props.info.parentID)
      } else if (event?.type === "session.idle" && parents.has(props.sessionID)) {
        await release(props.sessionID) // a subagent that finished its task
      } else if (event?.type === "session.deleted" && props.info?.id) {
        await release(props.info.id)
      }
    }),
    dispose: quietly(async () => {
      for (const callID of [...tools.keys()]) stop(callID)
      await Promise.all([...used].map((sessionID) => release(sessionID)))
    }),
  }
}
