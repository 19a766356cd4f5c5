// The shared HTTP contract (clients/contract/http.json): every case, run
// against the Express 5 and Express 4 middleware and the Fastify plugin, on a
// real PostgreSQL over real HTTP.  clients/contract/README.md says how a case
// is read.
import { test, describe, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { randomUUID } from 'node:crypto';
import pg from 'pg';
import Fastify from 'fastify';
import { expressIdempotency, fastifyIdempotency, idempotencyContext, PROBLEMS } from 'pg-idempotency';
import { db, deferred, exchange, expresses, listen, age } from './helpers.mjs';

const contractPath = process.env.IDEM_CONTRACT ?? new URL('../../contract/http.json', import.meta.url);
const contract = JSON.parse(readFileSync(contractPath, 'utf8'));

// application_name tells the runner's claims from other test files' (a waiting claim)
const pool = new pg.Pool({ max: 10, application_name: 'idem-contract' });
const NO_EXTENSION_DB = `${process.env.PGDATABASE ?? 'postgres'}_noext`;
let noExtensionPool;

before(async () => {
	await db.query(`DROP DATABASE IF EXISTS ${NO_EXTENSION_DB} WITH (FORCE)`);
	await db.query(`CREATE DATABASE ${NO_EXTENSION_DB}`);
	noExtensionPool = new pg.Pool({ database: NO_EXTENSION_DB, max: 2 });
	// DROP DATABASE ... WITH (FORCE) ends connections the pool may still be closing
	noExtensionPool.on('error', () => {});
});

after(async () => {
	await pool.end();
	await noExtensionPool.end();
	await db.query(`DROP DATABASE IF EXISTS ${NO_EXTENSION_DB} WITH (FORCE)`);
	await db.end();
});

/* the runner-level options become the middleware's; hooks record into `heard` */
function middlewareOptions(options = {}, heard = []) {
	const { keyHeader, pool: which, hooks, ...rest } = options;
	const out = { ...rest, pool: which === 'without-extension' ? noExtensionPool : pool, log: () => {} };
	if (keyHeader)
		out.key = (req) => req.headers[keyHeader] ?? null;
	if (hooks) {
		for (const [option, name] of [['onClaim', 'claim'], ['onReplay', 'replay'],
			['onConflict', 'conflict'], ['onMismatch', 'mismatch'], ['onExpired', 'expired'], ['onError', 'error']]) {
			out[option] = (event) => {
				heard.push({ name, key: event.key, scope: event.scope, hasRequest: event.request !== undefined });
				if (hooks === 'throw')
					throw new Error(`the ${option} hook throws`);
			};
		}
	}
	return out;
}

/* the key a request names in its header, as the hooks see it */
function keyOf(spec, runId) {
	const value = spec.headers?.['idempotency-key'];
	return value === undefined ? undefined : value.replaceAll('{run}', runId).replace(/^"(.*)"$/, '$1');
}

/* the case's handler: counts its runs, holds the first one when asked */
function makeHandler(spec) {
	const state = { runs: 0, entered: [], release: deferred() };
	async function answer(ctx) {
		state.runs++;
		const run = state.runs;
		const entered = state.entered.shift();
		entered?.resolve();
		if (spec.hold && run === 1)
			await state.release.promise;
		if (spec.throws)
			throw new Error('the handler failed');
		if (spec.echo) {
			const body = {};
			for (const field of spec.echo)
				body[field] = ctx?.[field];
			return { status: 200, headers: { 'content-type': 'application/json' }, body: Buffer.from(JSON.stringify(body)) };
		}
		const body = spec.bodyBytes !== undefined ? Buffer.alloc(spec.bodyBytes, 'x')
			: spec.body !== undefined ? Buffer.from(spec.body) : null;
		return { status: spec.status ?? 200, headers: spec.headers ?? {}, body };
	}
	return { state, answer };
}

async function startExpressCase(major, options, handler) {
	const app = expresses[major]();
	app.disable('x-powered-by');
	const idem = expressIdempotency(options);
	app.all('/things', idem, (req, res, next) => {
		handler.answer(idempotencyContext(req)).then((out) => {
			res.statusCode = out.status;
			for (const [name, value] of Object.entries(out.headers))
				res.setHeader(name, value);
			res.end(out.body ?? undefined);
		}, next);
	});
	app.use(idem.errors);
	return listen(app);
}

async function startFastifyCase(options, handler) {
	const app = Fastify();
	app.addContentTypeParser('*', { parseAs: 'buffer' }, (req, body, done) => done(null, body));
	await app.register(fastifyIdempotency, options);
	app.route({
		method: ['GET', 'POST', 'PATCH', 'PUT', 'DELETE'],
		url: '/things',
		handler: async (request, reply) => {
			const out = await handler.answer(idempotencyContext(request));
			reply.code(out.status).headers(out.headers);
			return out.body ?? '';
		},
	});
	await app.listen({ port: 0, host: '127.0.0.1' });
	return {
		url: `http://127.0.0.1:${app.server.address().port}`,
		async close() { await app.close(); },
	};
}

const targets = [
	{ name: 'express 5', start: (options, handler) => startExpressCase('express5', options, handler) },
	{ name: 'express 4', start: (options, handler) => startExpressCase('express4', options, handler) },
	{ name: 'fastify', start: startFastifyCase },
];

function request(url, spec, runId) {
	const fill = (text) => text.replaceAll('{run}', runId);
	const headers = {};
	for (const [name, value] of Object.entries(spec.headers ?? {}))
		headers[name] = fill(value);
	const body = spec.bodyBytes !== undefined ? Buffer.alloc(spec.bodyBytes, 'x')
		: spec.body !== undefined ? Buffer.from(fill(spec.body)) : null;
	if (body !== null)
		headers['content-length'] = String(body.length);
	return exchange(url + (spec.path ?? '/things'), {
		method: spec.method ?? 'POST', headers, parts: body === null ? [] : [body],
	});
}

/* true when the server shows a claim of the runner's pool waiting */
async function claimWaiting() {
	const { rows } = await db.query(`SELECT EXISTS (SELECT FROM pg_catalog.pg_stat_activity
	   WHERE application_name = 'idem-contract' AND state = 'active'
	     AND wait_event_type IN ('Extension', 'Lock', 'Timeout')
	     AND query LIKE '%idem_claim%') AS waiting`);
	return rows[0].waiting;
}

/* the answer of a request that may wait: the held handler is released once its claim waits */
async function waitingRequest(url, spec, runId, handler) {
	let answered = false;
	const pending = request(url, spec, runId).finally(() => { answered = true; });
	while (!answered && !(await claimWaiting()))
		await new Promise((resolve) => setTimeout(resolve, 5));
	handler.state.release.resolve();
	return pending;
}

function check(answer, expect, runs, where) {
	const say = `${where}: ${answer.text.slice(0, 300)}`;
	assert.equal(answer.status, expect.status, say);
	if (expect.problem) {
		const p = contract.problems[expect.problem];
		assert.match(answer.headers['content-type'] ?? '', /^application\/problem\+json/, say);
		const doc = JSON.parse(answer.text);
		assert.ok(doc.type.endsWith(expect.problem), `${where}: type ${doc.type}`);
		assert.equal(doc.title, p.title, where);
		assert.equal(doc.status, p.status, where);
	}
	for (const [name, value] of Object.entries(expect.headers ?? {}))
		assert.equal(answer.headers[name], value === null ? undefined : value, `${where}: header ${name}`);
	for (const [name, re] of Object.entries(expect.headersMatch ?? {}))
		assert.match(answer.headers[name] ?? '', new RegExp(`^(?:${re})$`), `${where}: header ${name}`);
	if (expect.body !== undefined)
		assert.equal(answer.text, expect.body, where);
	if (expect.bodyJson !== undefined)
		assert.deepEqual(JSON.parse(answer.text), expect.bodyJson, where);
	if (expect.bodyBytes !== undefined)
		assert.equal(answer.bytes.length, expect.bodyBytes, where);
	for (const [member, type] of Object.entries(expect.bodyTypes ?? {}))
		assert.equal(typeof JSON.parse(answer.text)[member], type, `${where}: type of ${member}`);
	for (const [member, value] of Object.entries(expect.bodyMembers ?? {}))
		assert.deepEqual(JSON.parse(answer.text)[member], value, `${where}: member ${member}`);
	if (expect.runs !== undefined)
		assert.equal(runs, expect.runs, `${where}: handler runs`);
}

test('the contract names every problem the middleware answers with', () => {
	assert.ok(Object.keys(contract.problems).length >= 11);
	assert.ok(contract.cases.length > 20);
});

test("the library's problem table is the contract's: every slug, status and title", () => {
	const library = Object.fromEntries(Object.entries(PROBLEMS).map(([slug, p]) => [slug, { status: p.status, title: p.title }]));
	assert.deepEqual(library, contract.problems);
});

for (const target of targets) {
	describe(`contract: ${target.name}`, () => {
		for (const c of contract.cases) {
			test(c.name, async () => {
				const handler = makeHandler(c.handler ?? {});
				const heard = [];
				const app = await target.start(middlewareOptions(c.options, heard), handler);
				const runId = randomUUID();
				const background = [];
				try {
					for (const [i, spec] of c.requests.entries()) {
						const where = `request ${i + 1}`;
						if (spec.ageKey)
							await age(keyOf(spec, runId));
						if (spec.background) {
							const entered = deferred();
							handler.state.entered.push(entered);
							background.push({ answer: request(app.url, spec, runId), spec, where });
							await entered.promise;
							continue;
						}
						const answer = spec.waits ? await waitingRequest(app.url, spec, runId, handler)
							: await request(app.url, spec, runId);
						check(answer, spec.expect, handler.state.runs, where);
						if (spec.expect.hooks !== undefined) {
							assert.deepEqual(heard.map((h) => h.name), spec.expect.hooks, `${where}: hooks`);
							for (const h of heard) {
								assert.equal(h.key, keyOf(spec, runId), `${where}: the ${h.name} hook's key`);
								assert.equal(h.scope, '', `${where}: the ${h.name} hook's scope`);
								assert.ok(h.hasRequest, `${where}: the ${h.name} hook's request`);
							}
						}
						heard.length = 0;
					}
				} finally {
					handler.state.release.resolve();
				}
				try {
					for (const b of background)
						check(await b.answer, b.spec.expect, handler.state.runs, `${b.where} (background)`);
				} finally {
					await app.close();
				}
			});
		}
	});
}
