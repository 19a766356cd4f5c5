'use strict';
/*
 * The HTTP engine: the framework-free behaviour of the Express middleware and
 * the Fastify plugin.  Per covered request it takes the key (the header, or
 * the key option) and the request's fingerprint, claims the key, and answers
 * with a replay, a problem (PROBLEMS) or a run of the handler, whose response
 * it stores or releases per the status policy before it is sent.  The
 * adapters only translate their framework's request and response to and from
 * it, so both behave alike.  With keepRequest the claim stores the request
 * (method, path, body) with the key, for a completer to finish it from.
 */

const { createHash } = require('node:crypto');
const { IdempotencyError, KeyLostError, MisconfiguredError } = require('./errors.cjs');
const {
	DEFAULT_LEASE, DEFAULT_RETENTION, SQLSTATE, rememberArg, claimStatement, isUnavailable, knownDatabase,
	misconfigurationDetail, poolInfo, isLostKey, seconds, positiveSeconds, rememberSeconds, requireRemember,
	keepRequestOption, requireKeepRequest, toJsonText, startHeartbeat, defaultLog, makeHooks, phaseDataOf, makeCheckpoint, releaseOrLost, finishOrLost,
} = require('./core.cjs');
const { parseIdempotencyKey, checkCustomKey } = require('./header.cjs');
const {
	FRAMING_HEADERS, isJsonType, jsonText, bodyMember, bodyLimit, TOO_LARGE, hasBody,
} = require('./bodies.cjs');
const { createCache } = require('./cache.cjs');

const DEFAULT_PROBLEM_BASE = 'urn:idempotency:problem:';
const DEFAULT_STORE_HEADERS = ['content-type', 'content-encoding', 'content-language',
	'location', 'etag', 'last-modified'];
/* headers that describe a body: not kept for a response stored without it */
const BODY_HEADERS = new Set(['content-type', 'content-encoding', 'content-language']);
const DEFAULT_RETRY_AFTER_MAX = 5;          /* seconds */
const DEFAULT_HANDLER_TIMEOUT = 300;        /* seconds */

/*
 * The HTTP finish: $8 is the JSON body text as the handler wrote it (null
 * when the body is not stored as JSON).  When jsonb's text of it differs, the
 * handler's ETag named bytes nobody gets, and it is not stored.  $9 is
 * remember, when set.
 */
const httpFinishSql = (remember) => `
SELECT (pg_catalog.date_part('epoch', f.expires_at) * 1000)::float8 AS expires_ms,
       ($4::jsonb -> 'json')::text AS json
  FROM idempotency.idem_finish(key => $1, token => $2::bigint, response_code => $3::int,
                               response_body => CASE
                                   WHEN $8::text IS NOT NULL
                                    AND ($4::jsonb -> 'json')::text IS DISTINCT FROM $8::text
                                   THEN $4::jsonb #- '{headers,etag}'
                                   ELSE $4::jsonb END,
                               scope => $5, status => $6,
                               retention => pg_catalog.make_interval(secs => $7::float8)${
	remember ? rememberArg(9) : ''})
       AS f(expires_at)`;
const HTTP_FINISH_SQL = [httpFinishSql(false), httpFinishSql(true)];

/* the stored result itself too: a cache entry needs the expiry of the result it holds */
const LOOKUP_SQL = `
SELECT (pg_catalog.date_part('epoch', l.expires_at) * 1000)::float8 AS expires_ms,
       l.status, l.response_code,
       (l.response_body -> 'headers')::text AS headers,
       (l.response_body -> 'json')::text AS json,
       l.response_body ->> 'base64' AS base64,
       l.response_body ->> 'omitted' AS omitted
  FROM idempotency.idem_lookup(key => $1, scope => $2) AS l`;

/* every problem the HTTP layer answers with: its status and title, by slug */
const PROBLEMS = Object.freeze(Object.fromEntries(Object.entries({
	'idempotency-key-missing': [400, 'Idempotency-Key header missing'],
	'idempotency-key-malformed': [400, 'Idempotency-Key header malformed'],
	'idempotency-key-repeated': [400, 'Idempotency-Key header repeated'],
	'idempotency-key-too-long': [400, 'Idempotency-Key too long'],
	'idempotency-key-in-use': [409, 'A request with this Idempotency-Key is in progress'],
	'idempotency-key-reused': [422, 'Idempotency-Key reused with a different request'],
	'idempotency-key-lost': [409, 'Idempotency-Key lost to a newer attempt'],
	'idempotency-key-expired': [410, 'Idempotency-Key already used; its stored response has expired'],
	'idempotency-request-too-large': [413, 'Request body too large'],
	'idempotency-misconfigured': [500, 'Idempotency middleware misconfigured'],
	'idempotency-unavailable': [503, 'Idempotency store briefly unavailable'],
	'idempotency-handler-timeout': [504, 'Request handler timed out'],
}).map(([slug, [status, title]]) => [slug, Object.freeze({ status, title })])));

/*
 * What a status means for the key: a 2xx or 3xx is the operation's outcome
 * and is kept; a 4xx says the request itself is wrong, so a retry of the same
 * request gets the same answer and it is kept too.  A 5xx says nothing about
 * the request (the server failed, perhaps before doing anything), so the key
 * is released and a retry runs the request again, unless the application
 * knows its 5xx are final (storeServerErrors).  408, 409, 425 and 429 say
 * "not now", which a retry may change: released.  A 304 answers the
 * conditional request of one client and means nothing to another: released.
 */
function defaultStorePolicy(status, { storeServerErrors = false } = {}) {
	if (status >= 500)
		return storeServerErrors ? 'failed' : 'release';
	if (status === 304)
		return 'release';
	if (status === 408 || status === 409 || status === 425 || status === 429)
		return 'release';
	if (status >= 400)
		return 'failed';
	return 'succeeded';
}

function headerValue(value) {
	if (Array.isArray(value))
		return value.map(String).join(', ');
	return String(value);
}

/* lower-case names; the framing headers go: the body is sent with its own Content-Length */
function normaliseHeaders(headers) {
	const out = {};
	for (const [name, value] of Object.entries(headers ?? {})) {
		const lower = name.toLowerCase();
		if (value !== undefined && value !== null && !FRAMING_HEADERS.has(lower))
			out[lower] = value;
	}
	return out;
}

/*
 * The framework-free part of the HTTP behaviour.  A framework adapter calls
 * begin() with the request's method, path, header lines, a reader of the raw
 * body and onTimeout(response); the answer is one of:
 *   { action: 'pass' }                       not covered: run the route as usual
 *   { action: 'respond', response }          answer now (4xx, 409, 422, 5xx, a replay)
 *   { action: 'run', context, complete, abandon }
 *       run the handler; hand its response to complete(), which stores it per
 *       the status policy and resolves to the response to send, or to null
 *       when onTimeout already answered the client.
 */
function createEngine(options) {
	const pool = options?.pool;
	if (!pool || typeof pool.query !== 'function')
		throw new TypeError('pg-idempotency needs options.pool: a pg Pool');
	const methods = new Set((options.methods ?? ['POST', 'PATCH']).map((m) => m.toUpperCase()));
	const required = options.required ?? true;
	const scopeOf = options.scope ?? (() => '');
	const keyOf = options.key ?? null;
	if (keyOf !== null && typeof keyOf !== 'function')
		throw new TypeError('options.key must be a function key(req) returning the key, or null when the request has none');
	const fingerprintOf = options.fingerprint ?? null;
	const lease = positiveSeconds(options.lease, 'lease', DEFAULT_LEASE);
	const retention = positiveSeconds(options.retention, 'retention', DEFAULT_RETENTION);
	const retryAfterMax = Math.max(1, Math.floor(positiveSeconds(options.retryAfterMax, 'retryAfterMax', DEFAULT_RETRY_AFTER_MAX)));
	/*
	 * How long a duplicate that arrives while the original runs waits, in its
	 * claim, for the original's answer (0: a 409 at once).  The server wakes
	 * the claim when the original finishes or releases the key.
	 */
	const wait = seconds(options.wait, 'wait', 0);
	/*
	 * How long the server remembers a key after its retention (its status and
	 * response code, not the body), so that a late retry gets a 410 instead
	 * of running again.  null: not sent, the server's idempotency.remember
	 * applies.  Fastify routes may set their own (config.idempotency.remember).
	 */
	const remember = rememberSeconds(options.remember);
	/*
	 * Store the request with the key (extension 1.8), so that a completer can
	 * finish a request whose process died.  Fastify routes may set their own
	 * (config.idempotency.keepRequest).
	 */
	const keepRequest = keepRequestOption(options.keepRequest);
	const handlerTimeout = options.handlerTimeout === 0 || options.handlerTimeout === null ? 0
		: positiveSeconds(options.handlerTimeout, 'handlerTimeout', DEFAULT_HANDLER_TIMEOUT);
	const maxBodySize = bodyLimit(options.maxBodySize);
	const canonicalJson = options.canonicalJson ?? false;
	if (typeof canonicalJson !== 'boolean')
		throw new TypeError(`canonicalJson must be a boolean, got ${String(canonicalJson)}`);
	const storeServerErrors = options.storeServerErrors ?? false;
	if (typeof storeServerErrors !== 'boolean')
		throw new TypeError(`storeServerErrors must be a boolean, got ${String(storeServerErrors)}`);
	const failedWrites = options.failedWrites ?? 'commit';
	if (failedWrites !== 'commit' && failedWrites !== 'rollback')
		throw new TypeError(`failedWrites must be 'commit' or 'rollback', got ${String(failedWrites)}`);
	const problemBase = options.problemTypeBase ?? DEFAULT_PROBLEM_BASE;
	const storePolicy = options.storePolicy ?? ((status) => defaultStorePolicy(status, { storeServerErrors }));
	const storeHeaders = [...new Set([...DEFAULT_STORE_HEADERS,
		...(options.storeHeaders ?? []).map((h) => String(h).toLowerCase())])]
		.filter((h) => !FRAMING_HEADERS.has(h));
	/* a response stored without its body keeps no header that describes the body */
	const omittedHeaders = storeHeaders.filter((h) => !BODY_HEADERS.has(h));
	const log = options.log ?? defaultLog;
	const hooks = makeHooks(options, log);
	const cache = options.cache ? createCache(Math.max(1, options.cache.max ?? 1000)) : null;
	const retentionHeader = String(Math.round(retention));
	const logged = new Set();

	/* members: the problem's extension members, after the standard ones */
	function problem(slug, status, detail, extraHeaders = {}, members = {}) {
		const body = Buffer.from(JSON.stringify({
			type: problemBase + slug, title: PROBLEMS[slug].title, status, detail, ...members,
		}));
		return {
			status,
			headers: {
				'content-type': 'application/problem+json',
				'idempotency-key-retention': retentionHeader,
				...extraHeaders,
			},
			body,
		};
	}

	const lostKey = () => problem('idempotency-key-lost', 409,
		'This attempt took longer than its lease and another attempt with the same ' +
		'Idempotency-Key took over; this result was not stored. Retry to get the stored result.');

	/*
	 * A remembered key: its request was processed, with the outcome and status
	 * in the members, and its response is gone.  410: repeating the request
	 * cannot bring the response back, and it is not run again.
	 */
	const expired = ({ status, response_code: code }) => problem('idempotency-key-expired', 410,
		`A request with this Idempotency-Key was already processed (it ${status}` +
		`${code === null ? '' : `, with status ${code}`}); its stored response has expired ` +
		'and the request is not run again. Use a new key for a new operation.',
		{}, { key_status: status, response_code: code });

	const unavailable = (detail = 'The result could not be recorded. Retry this request with the same Idempotency-Key.') =>
		problem('idempotency-unavailable', 503, detail, { 'retry-after': '1' });

	/* each distinct cause is logged once, not once per request */
	function misconfigured(detail, err) {
		if (!logged.has(detail)) {
			logged.add(detail);
			log(`pg-idempotency: misconfigured: ${detail}`, err);
		}
		return problem('idempotency-misconfigured', 500, detail);
	}

	/* a failed claim (or the check before it) as an answer: 503 when retrying helps, else 500 */
	function claimFailure(err, database) {
		if (err instanceof MisconfiguredError)
			return misconfigured(err.message, undefined);
		if (isUnavailable(err)) {
			log('pg-idempotency: the idempotency store is unavailable', err);
			return unavailable('The idempotency store could not be reached. Retry this request with the same Idempotency-Key.');
		}
		return misconfigured(misconfigurationDetail(err, database), err);
	}

	/* a stored envelope as an HTTP response */
	function replayResponse(row) {
		const headers = normaliseHeaders(row.headers === null ? {} : JSON.parse(row.headers));
		let body = Buffer.alloc(0);
		if (row.json !== null)
			body = Buffer.from(row.json);
		else if (row.base64 !== null)
			body = Buffer.from(row.base64, 'base64');
		const omitted = row.omitted ?? null;
		return {
			status: row.response_code ?? 200,
			headers: {
				...headers,
				'idempotent-replayed': 'true',
				...(omitted === null ? {} : { 'idempotent-body-omitted': String(omitted) }),
				'idempotency-key-retention': retentionHeader,
			},
			body,
		};
	}

	/* the fingerprint sent as jsonb text: built from the raw text, so numbers stay exact */
	function defaultFingerprint(method, path, contentType, body) {
		if (canonicalJson && isJsonType(contentType)) {
			const text = jsonText(body);
			if (text !== null)
				return `{"method":${JSON.stringify(method)},"path":${JSON.stringify(path)},"body":${text}}`;
		}
		return JSON.stringify({
			method, path, body_sha256: createHash('sha256').update(body).digest('hex'),
		});
	}

	/*
	 * The request a claim with keepRequest stores, which is also what its
	 * fingerprint hashes: the body itself, as its JSON text (compared as
	 * jsonb, as with canonicalJson) or as base64, so that a completer can run
	 * the request again from it.
	 */
	function keptRequest(method, path, contentType, body) {
		const head = `{"method":${JSON.stringify(method)},"path":${JSON.stringify(path)}`;
		if (isJsonType(contentType)) {
			const text = jsonText(body);
			if (text !== null)
				return `${head},"body":${text}}`;
		}
		return `${head},"body_base64":"${body.toString('base64')}"}`;
	}

	async function begin(req, { transactional = false, remember: routeRemember, keepRequest: routeKeep } = {}) {
		if (!methods.has(String(req.method).toUpperCase()))
			return { action: 'pass' };
		let parsed;
		if (keyOf) {
			const value = await keyOf(req.original);
			parsed = value === null || value === undefined ? { missing: true } : checkCustomKey(value);
		} else {
			parsed = parseIdempotencyKey(req.keyLines);
		}
		if (parsed.missing) {
			if (!required)
				return { action: 'pass' };
			return {
				action: 'respond',
				response: problem('idempotency-key-missing', 400,
					`${req.method} ${req.path.split('?')[0]} requires an Idempotency-Key header: ` +
					'a unique string of 1 to 255 characters per operation, sent again ' +
					'with every retry, e.g. Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324".'),
			};
		}
		if (parsed.problem)
			return { action: 'respond', response: problem(parsed.problem, 400, parsed.detail) };

		const tooLarge = () => ({
			action: 'respond',
			response: problem('idempotency-request-too-large', 413,
				`The request body is over ${maxBodySize} bytes, the most this endpoint accepts; ` +
				'the Idempotency-Key was not used.'),
		});
		if (Number(req.contentLength) > maxBodySize)
			return tooLarge();

		const key = parsed.key;
		const keeping = routeKeep === undefined ? keepRequest : keepRequestOption(routeKeep);
		let requestText;
		if (fingerprintOf) {
			/*
			 * The limit holds here too: a chunked body is read up to limit + 1
			 * bytes (and put back).  A body a parser already read without
			 * keeping its bytes was bounded by that parser.
			 */
			if (maxBodySize !== Infinity) {
				let body = null;
				try {
					body = await req.rawBody(maxBodySize);
				} catch (err) {
					if (!(err instanceof MisconfiguredError))
						throw err;
				}
				if (body === TOO_LARGE)
					return tooLarge();
			}
			requestText = toJsonText(await fingerprintOf(req.original), 'the request fingerprint');
		} else {
			let body;
			try {
				body = await req.rawBody(maxBodySize);
			} catch (err) {
				if (err instanceof MisconfiguredError)
					return { action: 'respond', response: misconfigured(err.message) };
				throw err;
			}
			if (body === TOO_LARGE)
				return tooLarge();
			requestText = (keeping ? keptRequest : defaultFingerprint)(
				String(req.method).toUpperCase(), req.path, req.contentType, body);
		}
		const scope = String((await scopeOf(req.original)) ?? '');
		const cacheId = `${scope}\u0000${key}`;

		if (cache) {
			const hit = cache.get(cacheId, requestText);
			if (hit) {
				hooks.replay({ key, scope, request: req.original, status: hit.status, cached: true });
				return { action: 'respond', response: hit, cached: true };
			}
		}

		const keep = routeRemember === undefined ? remember : rememberSeconds(routeRemember);
		const { sql: claimSql, params: claimParams } = claimStatement({
			key, request: requestText, scope, lease, retention, wait, remember: keep, keepRequest: keeping,
		});
		let client = null;
		let claim;
		let info = null;
		try {
			info = await poolInfo(pool, log);
			requireRemember(info, keep);
			requireKeepRequest(info, keeping);
			if (transactional) {
				client = await pool.connect();
				await client.query('BEGIN');
				claim = (await client.query(claimSql, claimParams)).rows[0];
				/*
				 * The savepoint after the claim: failedWrites 'rollback' returns
				 * to it, and so does a failed outcome whose handler left the
				 * transaction aborted (its writes are lost anyway).
				 */
				if (claim.outcome === 'claimed')
					await client.query('SAVEPOINT idem_handler');
				if (claim.outcome !== 'claimed') {
					await client.query('ROLLBACK');
					client.release();
					client = null;
				}
			} else {
				claim = (await pool.query(claimSql, claimParams)).rows[0];
			}
		} catch (err) {
			if (client)
				await discard(client);
			/* a request the server will not keep with its key: the client's to shorten, the key unused */
			if (keeping && err?.code === SQLSTATE.tooLarge)
				return {
					action: 'respond',
					response: problem('idempotency-request-too-large', 413,
						'The request is larger than the server keeps with an Idempotency-Key ' +
						'(idempotency.max_response_size); the Idempotency-Key was not used.'),
				};
			hooks.error({ key, scope, request: req.original, error: err });
			return { action: 'respond', response: claimFailure(err, info?.database ?? knownDatabase(pool)) };
		}

		switch (claim.outcome) {
			case 'replay': {
				const response = replayResponse(claim);
				hooks.replay({ key, scope, request: req.original, status: response.status, cached: false });
				if (cache)
					await fillCache(cacheId, requestText, response, claim, key, scope);
				return { action: 'respond', response };
			}
			case 'in_progress': {
				const wait = Math.ceil(Number(claim.retry_after ?? 1));
				const retryAfter = String(Math.min(Math.max(1, Number.isFinite(wait) ? wait : 1), retryAfterMax));
				hooks.conflict({ key, scope, request: req.original, retryAfter: Number(retryAfter) });
				return {
					action: 'respond',
					response: problem('idempotency-key-in-use', 409,
						'A request with the same Idempotency-Key is still being processed. ' +
						'Retry after the delay in Retry-After to get its result.',
						{ 'retry-after': retryAfter }),
				};
			}
			case 'mismatch':
				hooks.mismatch({ key, scope, request: req.original });
				return {
					action: 'respond',
					response: problem('idempotency-key-reused', 422,
						'This Idempotency-Key was already used for a different request ' +
						'(method, path or body). Use a new key for a new operation.'),
				};
			case 'expired':
				hooks.expired({ key, scope, request: req.original, status: claim.status, responseCode: claim.response_code });
				return { action: 'respond', response: expired(claim) };
			case 'claimed':
				break;
			default:
				throw new IdempotencyError(`unexpected claim outcome ${claim.outcome}`);
		}

		const token = claim.token;
		hooks.claim({ key, scope, request: req.original, token, attempt: claim.attempt });
		const failed = (error) => hooks.error({ key, scope, request: req.original, token, attempt: claim.attempt, error });
		const controller = new AbortController();
		let lost = false;
		const onLost = (err) => {
			lost = true;
			controller.abort(err);
		};
		const context = {
			key, scope, token, attempt: claim.attempt, signal: controller.signal,
			client: client ?? undefined,
			phase: claim.phase ?? null, phaseData: phaseDataOf(claim),
			checkpoint: makeCheckpoint(pool, { key, token, scope, defaultClient: client, onLost, info }),
		};
		/* a transaction's claim is invisible to others until COMMIT: no lease to keep */
		const heartbeat = transactional ? null : startHeartbeat(pool, {
			key, token, scope, lease, log,
			onLost: (err) => onLost(new KeyLostError(key, { cause: err })),
			onBeat: options.onHeartbeat,
		});
		let settled = false;
		let timedOut = false;
		/*
		 * Past handlerTimeout the client gets a 504.  In autocommit mode the
		 * lease is left to run out (no more heartbeats), so a retry may take the
		 * key over; the fencing token tells the downstream which attempt is
		 * newer.  In transactional mode the transaction's connection is
		 * destroyed now: the server rolls back the handler's writes and the
		 * uncommitted claim, so the connection goes back to the pool and the
		 * key is free at once, as after a thrown error; the late handler's
		 * statements on it fail, and its answer is dropped.
		 */
		const timer = handlerTimeout > 0 ? setTimeout(() => {
			if (settled)
				return;
			timedOut = true;
			heartbeat?.stop();
			if (client) {
				client.release(new IdempotencyError(`the handler of key ${JSON.stringify(key)} ` +
					`ran past handlerTimeout (${handlerTimeout} s); its transaction is rolled back`));
				client = null;
			}
			controller.abort(new IdempotencyError(`the handler of key ${JSON.stringify(key)} ` +
				`ran past handlerTimeout (${handlerTimeout} s)`));
			log(`pg-idempotency: the handler of key ${JSON.stringify(key)} ran past ` +
				`handlerTimeout (${handlerTimeout} s); answered 504`);
			req.onTimeout(problem('idempotency-handler-timeout', 504,
				`The request handler did not answer within ${handlerTimeout} s. Its outcome is ` +
				'unknown: retry later with the same Idempotency-Key to get the stored result, ' +
				'or to run the request again once its lease has ended.'));
		}, handlerTimeout * 1000) : null;
		timer?.unref?.();

		async function complete(response) {
			if (settled)
				throw new IdempotencyError('the response of this attempt was already completed');
			settled = true;
			clearTimeout(timer);
			await heartbeat?.stop();
			if (timedOut && transactional) {
				/* the client was told 504 and the transaction is gone: nothing to store */
				log(`pg-idempotency: the late handler of key ${JSON.stringify(key)} finished; ` +
					'its transaction was rolled back at the timeout and its answer is dropped');
				return null;
			}
			const answer = await store(response);
			return timedOut ? null : answer;
		}

		async function store(response) {
			const status = response.status;
			const headers = normaliseHeaders(response.headers);
			headers['idempotency-key-retention'] = retentionHeader;
			/* 204 and 304 carry no body, whatever a framework put in its payload */
			const body = hasBody(status) ? response.body ?? Buffer.alloc(0) : Buffer.alloc(0);
			if (lost) {
				log(`pg-idempotency: key ${JSON.stringify(key)} was lost while its handler ran; ` +
					'the result was not stored');
				failed(new KeyLostError(key));
				if (client) {
					await discard(client);
					client = null;
				}
				return lostKey();
			}
			let decision;
			try {
				/* a thrown error says nothing about the request: the key is released */
				decision = response.threw ? 'release' : storePolicy(status);
				if (decision !== 'succeeded' && decision !== 'failed' && decision !== 'release')
					throw new TypeError(`storePolicy(${status}) returned ${String(decision)}; ` +
						"expected 'succeeded', 'failed' or 'release'");
			} catch (err) {
				/* nothing is stored: give the key (and a transaction's client) back */
				if (client) {
					await discard(client);
					client = null;
				} else {
					await releaseOrLost(pool, key, token, scope).catch((e) =>
						log('pg-idempotency: release failed; the key frees itself when its lease ends', e));
				}
				throw err;
			}
			if (decision === 'release') {
				try {
					if (client) {
						await client.query('ROLLBACK');
						client.release();
						client = null;
					} else {
						await releaseOrLost(pool, key, token, scope);
					}
				} catch (err) {
					if (err instanceof KeyLostError) {
						log(`pg-idempotency: key ${JSON.stringify(key)} was lost before its release`, err);
						failed(err);
						return lostKey();
					}
					log('pg-idempotency: release failed; the key frees itself when its lease ends', err);
					if (client) {
						await discard(client);
						client = null;
					}
				}
				return { status, headers, body };
			}

			const stored = {};
			for (const name of storeHeaders)
				if (headers[name] !== undefined)
					stored[name] = headerValue(headers[name]);
			let member = bodyMember(headers['content-type'], body);
			const envelopeOf = (m) => `{"v":1,"headers":${JSON.stringify(stored)}` +
				(m === null ? '' : m.json !== undefined
					? `,"json":${m.json}` : `,"base64":"${m.base64}"`) + '}';
			let full = envelopeOf(member);
			const withoutBody = () => {
				const kept = {};
				for (const name of omittedHeaders)
					if (stored[name] !== undefined)
						kept[name] = stored[name];
				return { envelope: JSON.stringify({ v: 1, headers: kept, omitted: 'too-large' }), kept };
			};
			const maxResponseSize = info.maxResponseSize;
			let omitted = Buffer.byteLength(full) > maxResponseSize ? withoutBody() : null;
			/*
			 * A refused finish is tried again in another form, never given up
			 * by releasing the key: the handler ran, and a release would let a
			 * retry run it again.  Over the size limit (54000): without the
			 * body.  A JSON body jsonb cannot hold (class 22, e.g. a number
			 * numeric cannot hold): the handler's bytes as base64.
			 */
			const retryForm = (err) => {
				if (omitted === null && err?.code === SQLSTATE.tooLarge) {
					omitted = withoutBody();
					return true;
				}
				if (omitted === null && member?.json !== undefined && /^22/.test(String(err?.code))) {
					member = { base64: body.toString('base64') };
					full = envelopeOf(member);
					if (Buffer.byteLength(full) > maxResponseSize)
						omitted = withoutBody();
					return true;
				}
				return false;
			};
			let row;
			try {
				if (client) {
					let backToHandler = failedWrites === 'rollback' && decision === 'failed';
					if (backToHandler)
						await client.query('ROLLBACK TO SAVEPOINT idem_handler');
					for (;;) {
						/* a savepoint per try, so that a refused finish leaves the transaction usable */
						try {
							await client.query('SAVEPOINT idem_finish');
						} catch (err) {
							/* a failed statement of the handler aborted it: a failed outcome is still stored */
							if (err?.code !== SQLSTATE.aborted || decision !== 'failed' || backToHandler)
								throw err;
							backToHandler = true;
							await client.query('ROLLBACK TO SAVEPOINT idem_handler');
							continue;
						}
						try {
							row = (await client.query(HTTP_FINISH_SQL[keep === null ? 0 : 1],
								finishParams(omitted, full, member, decision, status))).rows[0];
							break;
						} catch (err) {
							if (!retryForm(err))
								throw err;
							await client.query('ROLLBACK TO SAVEPOINT idem_finish');
						}
					}
					await client.query('COMMIT');
					client.release();
					client = null;
				} else {
					for (;;) {
						try {
							row = await finishOrLost(pool, finishParams(omitted, full, member, decision, status), undefined,
								HTTP_FINISH_SQL[keep === null ? 0 : 1]);
							break;
						} catch (err) {
							if (!retryForm(err))
								throw err;
						}
					}
				}
			} catch (err) {
				if (client) {
					await discard(client);
					client = null;
				}
				failed(err);
				if (err instanceof KeyLostError || isLostKey(err)) {
					log(`pg-idempotency: key ${JSON.stringify(key)} was lost before its finish; ` +
						'the result was not stored', err);
					return lostKey();
				}
				/*
				 * Not released: the handler ran.  In autocommit mode the claim
				 * stays with this attempt until its lease ends (the heartbeat is
				 * stopped), then a retry takes the key over; in transactional
				 * mode the rollback took the handler's writes with the claim.
				 */
				if (isUnavailable(err) || (transactional && err?.code === SQLSTATE.aborted)) {
					log(`pg-idempotency: the result of key ${JSON.stringify(key)} could not be stored; ` +
						(transactional ? 'the transaction was rolled back'
							: 'the key is not released: a retry takes it over when its lease ends'), err);
					return unavailable();
				}
				const code = err?.code;
				return misconfigured(code === '42501' || code === '42883' || code === '3F000'
					? misconfigurationDetail(err, info.database)
					: `Storing the result failed with ${code ?? 'an error'} (${String(err?.message ?? err)}); ` +
						'retrying does not help: check the database and the idempotency extension.', err);
			}
			if (omitted !== null) {
				/* this client gets the whole response; retries get its status and headers */
				if (cache)
					cache.set(cacheId, requestText, replayResponse({
						headers: JSON.stringify(omitted.kept), json: null, base64: null,
						omitted: 'too-large', response_code: status,
					}), row.expires_ms);
				return { status, headers, body };
			}
			/* what this client sees is what every retry will see, byte for byte */
			const sent = member?.json !== undefined ? Buffer.from(row.json) : body;
			if (!sent.equals(body)) {
				/* an ETag named the bytes the handler wrote, which nobody gets */
				delete headers.etag;
				delete stored.etag;
			}
			if (cache)
				cache.set(cacheId, requestText, replayResponse({
					headers: JSON.stringify(stored), json: member?.json !== undefined ? row.json : null,
					base64: member?.base64 ?? null, response_code: status,
				}), row.expires_ms);
			return { status, headers, body: sent };
		}

		function finishParams(omitted, full, member, decision, status) {
			return [key, token, status, omitted === null ? full : omitted.envelope, scope, decision,
				retention, omitted === null && member?.json !== undefined ? member.json : null,
				...(keep === null ? [] : [keep])];
		}

		/* the request died without a response: give the key back */
		async function abandon(err) {
			if (settled)
				return;
			settled = true;
			clearTimeout(timer);
			await heartbeat?.stop();
			if (client) {
				await discard(client);
				client = null;
			} else if (!transactional) {
				await releaseOrLost(pool, key, token, scope).catch(() => {});
			}
			log('pg-idempotency: the request ended without a response; key released', err);
		}

		return { action: 'run', context, complete, abandon, get timedOut() { return timedOut; } };
	}

	/*
	 * The key may have been swept, or swept and settled anew, between the claim
	 * and this lookup: only the expiry of the replayed result itself may keep
	 * it in the cache.
	 */
	async function fillCache(cacheId, requestText, response, claim, key, scope) {
		try {
			const { rows } = await pool.query(LOOKUP_SQL, [key, scope]);
			const found = rows[0];
			if (found && found.status === claim.status && found.response_code === claim.response_code &&
				found.headers === claim.headers && found.json === claim.json &&
				found.base64 === claim.base64 && found.omitted === claim.omitted)
				cache.set(cacheId, requestText, response, found.expires_ms);
		} catch (err) {
			log('pg-idempotency: lookup for the cache failed', err);
		}
	}

	return { begin, cache, retentionHeader, problem, misconfigured };
}

/* roll back and return the client; a client that cannot roll back is destroyed */
async function discard(client) {
	try {
		await client.query('ROLLBACK');
		client.release();
	} catch (err) {
		client.release(err);
	}
}

/* the error a covered request's handler threw: its key is released (Express and Fastify) */
const THREW = Symbol('pg-idempotency.threw');
/* the engine's attempt of a covered request (Express and Fastify) */
const ATTEMPT = Symbol('pg-idempotency.attempt');

/* the attempt of an Express or Fastify request, if the request is covered and claimed */
function idempotencyContext(req) {
	return req?.idempotency ?? undefined;
}

module.exports = {
	PROBLEMS,
	defaultStorePolicy,
	createEngine,
	THREW,
	ATTEMPT,
	idempotencyContext,
};
