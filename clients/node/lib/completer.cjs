'use strict';
/*
 * The completer: finishes the keys of a scope that a crashed or stalled
 * attempt left pending, instead of waiting for the client to retry.  It owns
 * the LISTEN connection (idempotency_abandoned, on a connection of its own,
 * which must reach the server directly), the slow poll that backs it up, the
 * batches of idem_claim_abandoned up to `concurrency` keys in flight, and a
 * stop that lets running handlers end.  Running a taken-over key (heartbeat,
 * checkpoints, finish or release) is the job runner's (runClaimed in
 * jobs.cjs), so that a handler written for idempotent() runs here unchanged;
 * this file only adds what HTTP keys store (kind 'http').  It never claims a
 * key that is not abandoned: the server decides that.
 */

const {
	COMPLETER_EXTENSION_VERSION, DEFAULT_LEASE, requireVersion, poolInfo, positiveSeconds,
	rememberSeconds, toJsonText, defaultLog, makeHooks,
} = require('./core.cjs');
const { runClaimed, asCurrentJob } = require('./jobs.cjs');
const { defaultStorePolicy } = require('./http.cjs');
const { FRAMING_HEADERS, bodyMember, hasBody } = require('./bodies.cjs');

/* the channel every sweep that resets keys notifies, with the scope as payload */
const CHANNEL = 'idempotency_abandoned';
const DEFAULT_POLL_INTERVAL = 60;      /* seconds */
/* the LISTEN connection is tried again after 1 s, then twice as long each time, up to 30 s */
const RECONNECT_FIRST = 1000;
const RECONNECT_MOST = 30000;
/* idem_claim_abandoned takes at most this many keys in one call */
const MAX_KEYS = 10000;

/*
 * The row shape runClaimed reads from a claim: token and phase_data as text
 * (a bigint and jsonb untouched by the pool's type parsers), request too.
 */
const CLAIM_ABANDONED_SQL = `
SELECT a.key, a.token::text AS token, a.attempt, a.request::text AS request,
       a.phase, a.phase_data::text AS phase_data
  FROM idempotency.idem_claim_abandoned(scope => $1, max_keys => $2::int,
                                        lease => pg_catalog.make_interval(secs => $3::float8)) AS a`;

/* the completer's hooks, in the style of the others: a taken-over key, a settled one, a failure */
const COMPLETER_HOOKS = { onClaim: 'claim', onFinish: 'finish', onError: 'error' };

/* headers that describe a body: not kept for a response stored without it */
const BODY_HEADERS = new Set(['content-type', 'content-encoding', 'content-language']);

/*
 * What a handler of HTTP keys returns, { status, headers?, body? }, as the
 * finish stores it: the envelope the HTTP middlewares replay, so that the
 * client's retry gets it.  The status decides as in the middlewares (a 5xx
 * releases the key); a body is bytes (a Buffer), text (a string) or any
 * other JSON value.  Over maxResponseSize it is stored without its body.
 */
function httpResult(maxResponseSize) {
	return (out) => {
		if (out === null || typeof out !== 'object' || !Number.isInteger(out.status) ||
			out.status < 100 || out.status > 599)
			throw new TypeError('the handler of a completer of HTTP keys (kind: \'http\') must return ' +
				'{ status, headers, body } with an HTTP status');
		const decision = defaultStorePolicy(out.status);
		if (decision === 'release')
			return null;
		const headers = {};
		for (const [name, value] of Object.entries(out.headers ?? {})) {
			const lower = name.toLowerCase();
			if (value !== undefined && value !== null && !FRAMING_HEADERS.has(lower))
				headers[lower] = Array.isArray(value) ? value.map(String).join(', ') : String(value);
		}
		let bytes = Buffer.alloc(0);
		const body = out.body;
		if (hasBody(out.status) && body !== undefined && body !== null) {
			let type;
			if (Buffer.isBuffer(body) || body instanceof Uint8Array) {
				bytes = Buffer.from(body);
				type = 'application/octet-stream';
			} else if (typeof body === 'string') {
				bytes = Buffer.from(body);
				type = 'text/plain; charset=utf-8';
			} else {
				bytes = Buffer.from(toJsonText(body, 'the response body'));
				type = 'application/json; charset=utf-8';
			}
			headers['content-type'] ??= type;
		}
		const member = bodyMember(headers['content-type'], bytes);
		let envelope = `{"v":1,"headers":${JSON.stringify(headers)}` + (member === null ? '' :
			member.json !== undefined ? `,"json":${member.json}` : `,"base64":"${member.base64}"`) + '}';
		if (Buffer.byteLength(envelope) > maxResponseSize) {
			const kept = {};
			for (const [name, value] of Object.entries(headers))
				if (!BODY_HEADERS.has(name))
					kept[name] = value;
			envelope = JSON.stringify({ v: 1, headers: kept, omitted: 'too-large' });
		}
		return { envelope, status: decision, code: out.status };
	};
}

/*
 * How the LISTEN connection is made: a function returning a new pg.Client
 * (or a promise of one), not connected yet.  Not given: a client with the
 * pool's own settings, which is right only when the pool reaches the server
 * directly (not through PgBouncer in transaction mode).
 */
function listenFactory(listenClient, pool) {
	if (typeof listenClient === 'function')
		return listenClient;
	const Client = pool.Client ?? require('pg').Client;
	if (typeof listenClient === 'string')
		return () => new Client({ connectionString: listenClient });
	if (listenClient !== undefined && listenClient !== null) {
		if (typeof listenClient !== 'object')
			throw new TypeError('listenClient must be a connection string, a pg client config, a function ' +
				`returning a new pg.Client, or false, got ${typeof listenClient}`);
		return () => new Client(listenClient);
	}
	return () => new Client(pool.options ?? {});
}

/*
 * completer({ pool, scope, handler, ... }): a completer of one scope, not
 * started yet.  start() checks the extension, listens and polls once;
 * poll() takes over what is abandoned now; stop() ends it gracefully.
 */
function completer(options) {
	const pool = options?.pool;
	if (!pool || typeof pool.query !== 'function')
		throw new TypeError('completer({ pool, handler }) needs options.pool: a pg Pool (or anything with query())');
	const handler = options.handler;
	if (typeof handler !== 'function')
		throw new TypeError('completer({ pool, handler }) needs options.handler: the function that finishes a key');
	const scope = options.scope ?? '';
	if (typeof scope !== 'string')
		throw new TypeError(`options.scope must be a string, got ${typeof scope}`);
	const concurrency = options.concurrency ?? 1;
	if (!Number.isInteger(concurrency) || concurrency < 1 || concurrency > MAX_KEYS)
		throw new TypeError(`concurrency must be a whole number from 1 to ${MAX_KEYS}, got ${String(concurrency)}`);
	const lease = positiveSeconds(options.lease, 'lease', DEFAULT_LEASE);
	const pollInterval = positiveSeconds(options.pollInterval, 'pollInterval', DEFAULT_POLL_INTERVAL);
	/* null: not sent, the finish keeps what the original claim set */
	const retention = options.retention === undefined || options.retention === null ? null
		: positiveSeconds(options.retention, 'retention', null);
	const remember = rememberSeconds(options.remember);
	const retryable = options.retryable ?? (() => true);
	if (typeof retryable !== 'function')
		throw new TypeError('options.retryable must be a function of the error');
	const kind = options.kind ?? 'job';
	if (kind !== 'job' && kind !== 'http')
		throw new TypeError(`kind must be 'job' or 'http', got ${String(kind)}`);
	const log = options.log ?? defaultLog;
	const hooks = makeHooks(options, log, COMPLETER_HOOKS);
	const listen = options.listenClient === false ? null : listenFactory(options.listenClient, pool);

	let info = null;
	let started = false;
	let stopping = false;
	let stopped = null;
	const running = new Set();
	let pumping = null;
	let again = false;
	/* a claim filled every free slot, or a wake-up came while none was free: there may be more */
	let backlog = false;
	let pollTimer = null;
	let listener = null;
	let listening = false;
	let reconnectTimer = null;
	let reconnectDelay = RECONNECT_FIRST;

	/* take over up to the free slots' worth of abandoned keys, again while a batch comes back full */
	function pump() {
		if (pumping) {
			again = true;
			return pumping;
		}
		pumping = (async () => {
			let taken = 0;
			try {
				do {
					again = false;
					if (running.size >= concurrency)
						backlog = true;
					while (!stopping && running.size < concurrency) {
						const want = concurrency - running.size;
						const { rows } = await pool.query(CLAIM_ABANDONED_SQL, [scope, want, lease]);
						/* claimed is owned: each row runs, even if stop() came meanwhile */
						for (const row of rows)
							run(row);
						taken += rows.length;
						backlog = rows.length === want;
						if (rows.length < want)
							break;
					}
				} while (again && !stopping);
			} catch (err) {
				log(`pg-idempotency: the completer of scope ${JSON.stringify(scope)} could not take over ` +
					`abandoned keys; it tries again at the next notification or poll (${pollInterval} s)`, err);
			} finally {
				pumping = null;
			}
			return taken;
		})();
		return pumping;
	}

	/* run the handler for one taken-over key, from its recovery point with its stored request */
	function run(row) {
		const key = row.key;
		const request = row.request === null || row.request === undefined ? null : JSON.parse(row.request);
		const event = { key, scope, request, token: row.token, attempt: row.attempt };
		hooks.claim({ ...event, phase: row.phase ?? null });
		/* the handler's own error, once runClaimed settled the key after it (onFinish tells it) */
		let handlerError;
		const settled = (status, error) => {
			handlerError = error;
			hooks.finish(error === undefined ? { ...event, status } : { ...event, status, error });
		};
		const done = runClaimed(pool, row, {
			key, scope, request, lease, retention, remember, retryable, log, info, seen: null,
			result: kind === 'http' ? httpResult(info.maxResponseSize) : undefined, settled,
		}, (attempt) => asCurrentJob(attempt, () => handler(attempt)))
			.catch((err) => {
				log(`pg-idempotency: the completer's handler of key ${JSON.stringify(key)} ` +
					`(scope ${JSON.stringify(scope)}) ended with an error`, err);
				/* a lost key, or a failed finish or release: the store's, not the handler's */
				if (err !== handlerError || err === undefined)
					hooks.error({ ...event, error: err });
			})
			.finally(() => {
				running.delete(done);
				if (backlog && !stopping)
					pump();
			});
		running.add(done);
	}

	function schedulePoll() {
		clearTimeout(pollTimer);
		if (stopping)
			return;
		pollTimer = setTimeout(() => {
			pump().finally(schedulePoll);
		}, pollInterval * 1000);
	}

	async function connectListener() {
		reconnectTimer = null;
		if (stopping)
			return;
		let client = null;
		try {
			client = await listen();
			const lost = (err) => {
				if (listener !== client)
					return;
				listener = null;
				listening = false;
				client.end().catch(() => {});
				if (stopping)
					return;
				log(`pg-idempotency: the completer's LISTEN connection (scope ${JSON.stringify(scope)}) ` +
					'ended; it polls until it is back', err);
				scheduleReconnect();
			};
			client.on('error', lost);
			client.on('end', () => lost(new Error('the LISTEN connection ended')));
			client.on('notification', (msg) => {
				if (msg.channel === CHANNEL && msg.payload === scope && !stopping)
					pump();
			});
			await client.connect();
			await client.query(`LISTEN ${CHANNEL}`);
			if (stopping) {
				await client.end().catch(() => {});
				return;
			}
			listener = client;
			listening = true;
			reconnectDelay = RECONNECT_FIRST;
			/* what was notified while nobody listened is lost: look now */
			pump();
		} catch (err) {
			if (client !== null && listener !== client)
				client.end?.().catch(() => {});
			if (stopping)
				return;
			log(`pg-idempotency: the completer (scope ${JSON.stringify(scope)}) could not LISTEN on ` +
				`${CHANNEL}; it polls every ${pollInterval} s until it can`, err);
			scheduleReconnect();
		}
	}

	function scheduleReconnect() {
		if (stopping || reconnectTimer !== null)
			return;
		const delay = reconnectDelay;
		reconnectDelay = Math.min(reconnectDelay * 2, RECONNECT_MOST);
		reconnectTimer = setTimeout(connectListener, delay);
	}

	return {
		/*
		 * Check the extension (1.8 or later), listen, and take over what is
		 * abandoned now.  Resolves once the first LISTEN was tried (a failed
		 * one is tried again in the background while the poll goes on).
		 */
		async start() {
			if (started)
				throw new Error('this completer was already started');
			started = true;
			info = await poolInfo(pool, log);
			requireVersion(info, COMPLETER_EXTENSION_VERSION, ' (completer)');
			if (listen !== null)
				await connectListener();
			/* listening, the LISTEN looked already; else look once now, then at each poll */
			if (!listening)
				pump();
			schedulePoll();
		},
		/* take over what is abandoned now; resolves with the number of keys taken over */
		async poll() {
			if (!started || stopping)
				return 0;
			return pump();
		},
		/*
		 * Take over nothing more, close the LISTEN connection, and resolve once
		 * every running handler has settled its key.
		 */
		stop() {
			if (stopped === null) {
				stopping = true;
				stopped = (async () => {
					clearTimeout(pollTimer);
					clearTimeout(reconnectTimer);
					const client = listener;
					listener = null;
					listening = false;
					if (client !== null)
						await client.end().catch(() => {});
					if (pumping)
						await pumping;
					while (running.size > 0)
						await Promise.allSettled([...running]);
				})();
			}
			return stopped;
		},
		/* the handlers running now */
		get running() {
			return running.size;
		},
		/* whether the LISTEN connection is up (false: the completer only polls) */
		get listening() {
			return listening;
		},
	};
}

module.exports = { completer };
