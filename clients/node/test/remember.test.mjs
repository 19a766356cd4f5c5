// Remembered keys (extension 1.7): the remember option of jobs and of the
// HTTP middlewares, ExpiredError and the 410 idempotency-key-expired answer,
// the onExpired hook, and the same client on an extension before 1.7, where
// it sends no remember argument unless told to and then names the version it
// needs.  A key is moved past its retention by age() instead of waiting.
import { test, describe, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { createRequire } from 'node:module';
import { randomUUID } from 'node:crypto';
import pg from 'pg';
import Fastify from 'fastify';
import {
	idempotent, idempotentJob, fastifyIdempotency, idempotencyContext, ExpiredError, MismatchError,
	MisconfiguredError, IdempotencyError,
} from 'pg-idempotency';
import { db, newKey, age, send, problemOf, frameworks, waitFor, createTestOrders } from './helpers.mjs';

const { version: CLIENT_VERSION } = createRequire(import.meta.url)('pg-idempotency/package.json');
const DAY = 86400;
const pool = new pg.Pool({ max: 6 });
/* sessions where the server remembers every key for an hour unless told otherwise */
const remembering = new pg.Pool({ max: 2, options: '-c idempotency.remember=3600' });

before(createTestOrders);

after(async () => {
	await pool.end();
	await remembering.end();
	await db.end();
});

/* the remember a key's row holds, in seconds; null: the key is not remembered */
async function rememberOf(key, scope = '') {
	const { rows } = await db.query(
		`SELECT pg_catalog.date_part('epoch', remember)::float8 AS s
		   FROM idempotency.keys WHERE scope = $1 AND key = $2`, [scope, key]);
	assert.equal(rows.length, 1, `the row of ${key}`);
	return rows[0].s;
}

/* a pool that keeps the text of every statement it runs */
function textPool(inner) {
	const texts = [];
	return {
		texts,
		query: (sql, params) => {
			texts.push(sql);
			return inner.query(sql, params);
		},
	};
}

/* hooks that record the expired and error events they hear */
function listening(heard) {
	return {
		onExpired: (event) => heard.push({ name: 'expired', ...event }),
		onError: (event) => heard.push({ name: 'error', ...event }),
	};
}

// ------------------------------------------------------------------ jobs

test('a job past its retention with remember throws ExpiredError and does not run again', async () => {
	const key = newKey('payout');
	const scope = 'payouts';
	const request = { amount: 500 };
	let runs = 0;
	const heard = [];
	const options = { key, scope, request, remember: 30 * DAY, ...listening(heard) };
	const first = await idempotent(pool, options, async () => { runs += 1; return 'paid'; });
	assert.equal(first.value, 'paid');
	assert.equal(await rememberOf(key, scope), 30 * DAY);
	assert.equal((await idempotent(pool, options, async () => { runs += 1; })).replayed, true);
	await age(key, scope);

	const err = await idempotent(pool, options, async () => { runs += 1; }).catch((e) => e);
	assert.ok(err instanceof ExpiredError, String(err));
	assert.ok(err instanceof IdempotencyError);
	assert.equal(err.name, 'ExpiredError');
	assert.deepEqual([err.key, err.scope, err.status, err.responseCode], [key, scope, 'succeeded', null]);
	assert.match(err.message, /was already used \(it succeeded\); its stored result has expired/);
	assert.equal(runs, 1);
	assert.deepEqual(heard.map((h) => [h.name, h.key, h.scope, h.status, h.responseCode]),
		[['expired', key, scope, 'succeeded', null]], 'onExpired, and no onError');
	assert.deepEqual(heard[0].request, request);

	/* the server decides: a call without the option gets the same answer */
	await assert.rejects(idempotent(pool, { key, scope, request }, async () => { runs += 1; }), ExpiredError);
	/* another request on the remembered key is a mismatch, as on a live one */
	await assert.rejects(idempotent(pool, { ...options, request: { amount: 1 } }, async () => { runs += 1; }),
		MismatchError);
	assert.equal(runs, 1);
});

test('a failure stored with remember expires as failed', async () => {
	const key = newKey('payout');
	const declined = new Error('card declined');
	const options = { key, remember: DAY, retryable: () => false };
	await assert.rejects(idempotent(pool, options, async () => { throw declined; }), (e) => e === declined);
	await age(key);
	const err = await idempotent(pool, options, async () => 'again').catch((e) => e);
	assert.ok(err instanceof ExpiredError);
	assert.equal(err.status, 'failed');
});

test('idempotentJob takes remember: a call past the retention throws ExpiredError', async () => {
	let runs = 0;
	const heard = [];
	const payOut = idempotentJob(pool, { key: (id) => id, remember: DAY, ...listening(heard) },
		async function payOut(id) { runs += 1; return `paid ${id}`; });
	const id = newKey('order');
	assert.equal(await payOut(id), `paid ${id}`);
	await age(id, 'payOut');
	await assert.rejects(payOut(id), (e) => e instanceof ExpiredError && e.scope === 'payOut' && e.key === id);
	assert.equal(runs, 1);
	assert.deepEqual(heard.map((h) => h.name), ['expired']);
});

test('remember is named only when set; without it an aged key runs again', async () => {
	const plain = textPool(pool);
	const key = newKey('plain');
	await idempotent(plain, { key }, async () => 1);
	assert.ok(plain.texts.length >= 2);
	assert.ok(plain.texts.every((sql) => !/remember/.test(sql)), 'no remember argument in any statement');
	assert.equal(await rememberOf(key), null);
	await age(key);
	const again = await idempotent(pool, { key }, async ({ attempt }) => attempt);
	assert.equal(again.replayed, false, 'a key that is not remembered runs again past its retention');

	const kept = textPool(pool);
	await idempotent(kept, { key: newKey('kept'), remember: 60 }, async () => 1);
	assert.deepEqual(kept.texts.filter((sql) => /idem_(claim|finish)\(/.test(sql))
		.map((sql) => /remember => /.test(sql)), [true, true], 'claim and finish both name remember');
});

test('the server setting remembers a key without the option; remember: 0 turns it off for a key', async () => {
	const key = newKey('setting');
	await idempotent(remembering, { key }, async () => 'kept');
	assert.equal(await rememberOf(key), 3600);
	await age(key);
	await assert.rejects(idempotent(remembering, { key }, async () => 'again'), ExpiredError);

	const off = newKey('setting');
	await idempotent(remembering, { key: off, remember: 0 }, async () => 'not kept');
	assert.equal(await rememberOf(off), null);
	await age(off);
	assert.equal((await idempotent(remembering, { key: off, remember: 0 }, async () => 'ran')).value, 'ran');
});

test('a bad remember or onExpired is a TypeError before any statement', async () => {
	const counted = textPool(pool);
	for (const remember of [-1, 'a day', Number.NaN, Infinity])
		await assert.rejects(idempotent(counted, { key: newKey(), remember }, async () => 1),
			(e) => e instanceof TypeError && /remember must be a number of seconds/.test(e.message), String(remember));
	await assert.rejects(idempotent(counted, { key: newKey(), onExpired: 'log it' }, async () => 1),
		/onExpired must be a function/);
	assert.deepEqual(counted.texts, []);
});

// ------------------------------------------------------------------ HTTP

for (const fw of frameworks) {
	describe(`${fw.name}: remembered keys`, () => {
		test('a retry past the retention gets 410 with the original outcome; another body 422', async () => {
			const heard = [];
			const app = await fw.start({ pool, remember: 7 * DAY, log: () => {}, ...listening(heard) });
			try {
				const key = newKey('http');
				assert.equal((await send(app.url, '/echo', { key })).status, 201);
				assert.equal(await rememberOf(key), 7 * DAY, 'claim and finish store remember');
				await age(key);

				const late = await send(app.url, '/echo', { key });
				const p = problemOf(late, 410, 'idempotency-key-expired');
				assert.equal(p.title, 'Idempotency-Key already used; its stored response has expired');
				assert.equal(p.key_status, 'succeeded');
				assert.equal(p.response_code, 201);
				assert.match(p.detail, /already processed \(it succeeded, with status 201\); its stored response has expired/);
				assert.equal(late.headers['idempotency-key-retention'], '86400');
				assert.equal(late.headers['idempotent-replayed'], undefined);
				assert.equal(app.control.count(key), 1);
				assert.deepEqual(heard.map((h) => [h.name, h.key, h.scope, h.status, h.responseCode]),
					[['expired', key, '', 'succeeded', 201]]);
				assert.ok(heard[0].request, 'the hook gets the request');

				problemOf(await send(app.url, '/echo', { key, body: '{"amount":1}' }), 422, 'idempotency-key-reused');
				assert.equal(app.control.count(key), 1);

				/* a stored 4xx comes back as failed, with its status */
				const refused = newKey('http');
				assert.equal((await send(app.url, '/status?code=400', { key: refused })).status, 400);
				await age(refused);
				const q = problemOf(await send(app.url, '/status?code=400', { key: refused }), 410, 'idempotency-key-expired');
				assert.deepEqual([q.key_status, q.response_code], ['failed', 400]);
			} finally {
				await app.close();
			}
		});

		test('the transactional mode stores remember with its finish', async () => {
			const app = await fw.start({ pool, remember: DAY, log: () => {} });
			try {
				const key = newKey('tx');
				assert.equal((await send(app.url, '/tx', { key, body: '{"note":"kept"}' })).status, 201);
				assert.equal(await rememberOf(key), DAY);
				await age(key);
				problemOf(await send(app.url, '/tx', { key, body: '{"note":"kept"}' }), 410, 'idempotency-key-expired');
				assert.equal(app.control.count(key), 1);
			} finally {
				await app.close();
			}
		});

		test('the server setting alone makes the answer 410: the middleware needs no option to read it', async () => {
			const app = await fw.start({ pool: remembering, log: () => {} });
			try {
				const key = newKey('setting');
				assert.equal((await send(app.url, '/echo', { key })).status, 201);
				assert.equal(await rememberOf(key), 3600);
				await age(key);
				problemOf(await send(app.url, '/echo', { key }), 410, 'idempotency-key-expired');
			} finally {
				await app.close();
			}
		});
	});
}

test('fastify: a route\'s own remember replaces the plugin\'s', async () => {
	const app = Fastify();
	await app.register(fastifyIdempotency, { pool, log: () => {} });
	let runs = 0;
	const handler = async (request) => { runs += 1; return { key: idempotencyContext(request).key }; };
	app.post('/payouts', { config: { idempotency: { remember: 30 * DAY } } }, handler);
	app.post('/carts', handler);
	await app.listen({ port: 0, host: '127.0.0.1' });
	const url = `http://127.0.0.1:${app.server.address().port}`;
	try {
		const payout = newKey('route');
		const cart = newKey('route');
		assert.equal((await send(url, '/payouts', { key: payout })).status, 200);
		assert.equal((await send(url, '/carts', { key: cart })).status, 200);
		assert.equal(await rememberOf(payout), 30 * DAY);
		assert.equal(await rememberOf(cart), null);
		await age(payout);
		await age(cart);
		problemOf(await send(url, '/payouts', { key: payout }), 410, 'idempotency-key-expired');
		assert.equal((await send(url, '/carts', { key: cart })).status, 200, 'not remembered: runs again');
		assert.equal(runs, 3);
	} finally {
		await app.close();
	}
});

test('fastify: a bad remember in a route\'s config fails when the route is added', async () => {
	const app = Fastify();
	await app.register(fastifyIdempotency, { pool });
	assert.throws(() => app.post('/x', { config: { idempotency: { remember: -5 } } }, async () => 'x'),
		/remember must be a number of seconds/);
	await app.close();
});

test('the middlewares refuse a bad remember when they are built', async () => {
	for (const fw of frameworks)
		await assert.rejects(fw.start({ pool, remember: -1 }), /remember must be a number of seconds/, fw.name);
});

// ------------------------------------------------------ extension versions before 1.7

test('on extension 1.6 both work without remember; with it they name the version they need', async () => {
	const name = `idem_node_v16_${randomUUID().slice(0, 8)}`;
	await db.query(`CREATE DATABASE ${name}`);
	const old = new pg.Pool({ database: name, max: 2 });
	const apps = [];
	try {
		await old.query(`CREATE EXTENSION idempotency VERSION '1.6'`);
		const needs = `pg-idempotency ${CLIENT_VERSION} (remember) needs the idempotency extension 1.7 ` +
			`or later; database "${name}" has 1.6: run ALTER EXTENSION idempotency UPDATE.`;

		const key = newKey('v16');
		assert.equal((await idempotent(old, { key }, async () => 'old')).value, 'old');
		assert.equal((await idempotent(old, { key }, async () => 'again')).replayed, true);
		const unclaimed = newKey('v16');
		let ran = false;
		await assert.rejects(idempotent(old, { key: unclaimed, remember: DAY }, async () => { ran = true; }),
			(e) => e instanceof MisconfiguredError && e.message === needs);
		assert.equal(ran, false);
		assert.equal((await old.query('SELECT count(*)::int AS n FROM idempotency.keys WHERE key = $1',
			[unclaimed])).rows[0].n, 0, 'refused before the claim');

		for (const fw of frameworks) {
			const plain = await fw.start({ pool: old, log: () => {} });
			const kept = await fw.start({ pool: old, remember: DAY, log: () => {} });
			apps.push(plain, kept);
			assert.equal((await send(plain.url, '/echo', { key: newKey('v16') })).status, 201, fw.name);
			const refusedKey = newKey('v16');
			const p = problemOf(await send(kept.url, '/echo', { key: refusedKey }), 500, 'idempotency-misconfigured');
			assert.equal(p.detail, needs, fw.name);
			assert.equal(kept.control.count(refusedKey), 0, `${fw.name}: the handler never runs`);
		}
	} finally {
		for (const app of apps)
			await app.close();
		await old.end();
		await waitFor(async () => (await db.query(
			'SELECT count(*)::int AS n FROM pg_stat_activity WHERE datname = $1', [name])).rows[0].n === 0,
		'the old database\'s sessions to end');
		await db.query(`DROP DATABASE ${name}`);
	}
});
