
# Copyright: the idempotency extension authors.
#
# 206_upgrade.pl: ALTER EXTENSION idempotency UPDATE from 1.0 to 1.1.
#
# What it proves:
#   - a 1.0 database full of keys (finished ones, pending ones under live
#     leases, one whose lease ended) updates to 1.1 without touching a stored
#     row (same ctid and xmin, every column identical) or the token sequence;
#   - after the update every finished key replays its stored result, the
#     pending keys' owners extend and finish them with the tokens they got
#     from 1.0, a wrong or dead token is still refused (55006, 55000), the
#     key whose lease ended is taken over as attempt 2 with a larger token,
#     the stats view counts on, and a statement another session prepared
#     under 1.0 still runs;
#   - a dump taken under 1.0 restores into the newest version with every key
#     as it was;
#   - idem_claim returns SETOF idempotency.claim_result, and the updated
#     catalog is the one a fresh 1.1 install makes: every function of the
#     extension (definition, owner, privileges), the type's columns, the
#     tables, sequence and view, the member list, the configuration tables
#     and the initial privileges;
#   - privileges an administrator changed on idem_claim under 1.0 (EXECUTE
#     revoked from PUBLIC, granted per role, also by a role holding the grant
#     option) are the same after the update, and pg_dump still carries them;
#     no role dependency of initial privileges is left behind (PostgreSQL
#     17+), so once their grants are revoked the granted roles can be
#     dropped;
#   - a user view or BEGIN ATOMIC function that uses idem_claim makes the
#     update fail with 2BP01: nothing changes, 1.0 keeps working, and after
#     dropping it, updating and creating it again it works on 1.1.
#
# Run it like the other TAP tests (see the top of t/001_restart.pl).  Port
# 55470 only names the socket file.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use List::Util qw(max);
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

# No sweeps: the key whose lease ended stays pending until the test takes it
# over, and no finished key's sweep_at moves.
my $node = new_node('upgrade', port => 55470,
	init => [ extra => [ '--encoding=UTF8', '--locale=C' ] ],
	conf => ['idempotency.sweep_interval = 0']);

sub sql { my ($db, $sql) = @_; return $node->safe_psql($db, $sql); }

my $claim_sig = $CLAIM_SIG;
my $table_result =
    'TABLE(outcome text, token bigint, attempt integer, status text, '
  . 'response_code integer, response_body jsonb, retry_after integer)';
my $setof_result = 'SETOF idempotency.claim_result';

# "version|result type of idem_claim|claim_result exists|functions named idem_claim*"
sub ext_state
{
	my ($db) = @_;
	return sql($db,
		    "SELECT concat_ws('|', e.extversion, "
		  . "(SELECT pg_get_function_result(p.oid) FROM pg_proc p "
		  . "WHERE p.proname = 'idem_claim' "
		  . "AND p.pronamespace = 'idempotency'::regnamespace), "
		  . "to_regtype('idempotency.claim_result') IS NOT NULL, "
		  . "(SELECT count(*) FROM pg_proc WHERE proname = 'idem_claim' "
		  . "OR proname LIKE 'idem\\_claim\\_1\\_%')) "
		  . "FROM pg_extension e WHERE e.extname = 'idempotency'");
}

# Every stored key, one line each, as key_rows reads them.
sub rows { my ($db, $keys) = @_; return key_rows($node, $db, $keys); }

my $counters_sql =
    "SELECT concat_ws(',', claims, takeovers, replays, in_progress, mismatches, "
  . "finishes, releases) FROM idempotency.stats WHERE database = current_database()";
my $key_counts_sql =
    "SELECT concat_ws(',', pending, succeeded, failed) FROM idempotency.stats "
  . "WHERE database = current_database()";

# The counters after $ops more of each kind than $before (same order).
sub counters_plus
{
	my ($before, @ops) = @_;
	my @c = split /,/, $before;
	return join(',', map { $c[$_] + $ops[$_] } 0 .. $#c);
}

# =========================================================================
# A 1.0 database with keys in every state
# =========================================================================
sql('postgres', 'CREATE DATABASE up');
sql('up', "CREATE EXTENSION idempotency VERSION '1.0'");
is(ext_state('up'), "1.0|$table_result|f|1",
	'up: 1.0 is installed: idem_claim RETURNS TABLE, no claim_result type');

my @tokens;
sub claimed
{
	my ($args) = @_;
	my $c = claim($node, 'up', $args);
	is($c->{outcome}, 'claimed', "up: claim($args) is claimed");
	push @tokens, $c->{token};
	return $c;
}

my %body = (
	ok     => q{'{"charge": "ch_1", "total": 100.0}'},
	failed => q{'{"error": "card declined"}'},
	kept   => q{(SELECT jsonb_build_object('blob', }
	  . q{string_agg(md5(i::text), '' ORDER BY i)) FROM generate_series(1, 3000) AS i)},
	live1  => q{'{"late": 1}'},
	live2  => q{'{"late": 2}'},
	taken  => q{'{"attempt": 2}'},
);
my %md5;
$md5{$_} = body_md5($node, 'up', $body{$_}) foreach keys %body;

# Finished keys (leases of an hour: nothing about them is due while the
# test runs).
my $c = claimed(q{'ok-1', request => '{"order": 1}', lease => '1 hour'});
sql('up', "SELECT idempotency.idem_finish('ok-1', $c->{token}, 201, $body{ok})");
$c = claimed(q{'fail-1', request => '{"order": 2}', lease => '1 hour'});
sql('up',
	    "SELECT idempotency.idem_finish('fail-1', $c->{token}, 402, $body{failed}, "
	  . "status => 'failed', retention => '2 hours')");
$c = claimed(q{'kept-done', scope => 'a:shop', lease => '1 hour'});
sql('up',
	"SELECT idempotency.idem_finish('kept-done', $c->{token}, 200, $body{kept}, scope => 'a:shop')");

# Pending keys under live leases; their owners keep the tokens.
my $live1 = claimed(q{'live-1', request => '{"job": 1}', lease => '1 hour'})->{token};
my $live2 = claimed(q{'live-2', request => '{"job": 2}', lease => '1 hour'})->{token};
claimed(q{'kept-pending', lease => '1 hour'});

# A pending key whose lease has ended.
my $ended = claimed(q{'ended', request => '{"job": 9}', lease => '10 ms'})->{token};
ok(wait_lease_over($node, 'up', '', 'ended'), 'up: the lease of "ended" has run out');

# Another session prepares statements under 1.0 and keeps them.
my $session = $node->background_psql('up');
$session->query_safe(
	"PREPARE replay_ok AS SELECT outcome, response_code FROM "
	  . q{idempotency.idem_claim('ok-1', '{"order": 1}')});
$session->query_safe(
	"PREPARE claim_new(text) AS SELECT outcome, attempt FROM "
	  . "idempotency.idem_claim(\$1, lease => '1 hour')");
is($session->query_safe('EXECUTE replay_ok'), 'replay|201',
	'session: the statement prepared under 1.0 replays ok-1');

# 1.0's RETURNS TABLE columns, the names and types of idem_claim's OUT
# parameters in order, are what claim_result must have.
my $table_columns = sql('up',
	    "SELECT string_agg(a.n || ' ' || format_type(a.t, NULL), ', ' ORDER BY a.i) "
	  . "FROM pg_proc p, unnest(p.proargnames, p.proallargtypes, p.proargmodes::text[]) "
	  . "WITH ORDINALITY AS a(n, t, m, i) "
	  . "WHERE p.oid = '$claim_sig'::regprocedure AND a.m = 't'");
like($table_columns, qr/^outcome text, .*, retry_after integer$/,
	'up: 1.0\'s idem_claim has its RETURNS TABLE columns');

my %before = (
	rows     => rows('up'),
	seq      => sql('up', 'SELECT last_value FROM idempotency.token_seq'),
	counts   => sql('up', $key_counts_sql),
);
is($before{counts}, '4,2,1', 'up: 4 pending, 2 succeeded, 1 failed keys');
is($before{seq}, max(@tokens), 'up: the sequence stands at the largest token issued');

# A dump taken under 1.0 (pg_dump names no extension version).
my $dir = PostgreSQL::Test::Utils::tempdir;
$node->command_ok([ 'pg_dump', '-Fc', '-d', $node->connstr('up'), '-f', "$dir/up.dump" ],
	'up: pg_dump under 1.0');

# =========================================================================
# The update
# =========================================================================
is(sqlstate_of($node, 'up', "ALTER EXTENSION idempotency UPDATE TO '1.1'"), '00000',
	'up: ALTER EXTENSION idempotency UPDATE TO \'1.1\' succeeds');
is(ext_state('up'), "1.1|$setof_result|t|1",
	'up: 1.1: idem_claim returns SETOF idempotency.claim_result, one idem_claim');
is(rows('up'), $before{rows},
	'up: every stored row is the same tuple (ctid, xmin), column for column');
is(sql('up', 'SELECT last_value FROM idempotency.token_seq'), $before{seq},
	'up: the token sequence did not move');
is( sql('up',
		"SELECT has_function_privilege('public', '$claim_sig', 'EXECUTE')"),
	't', 'up: PUBLIC may execute idem_claim, as under 1.0');

is( sql('up',
		    "SELECT string_agg(attname || ' ' || format_type(atttypid, atttypmod), ', ' "
		  . "ORDER BY attnum) FROM pg_attribute "
		  . "WHERE attrelid = 'idempotency.claim_result'::regclass AND attnum > 0"),
	$table_columns, 'up: claim_result has the columns of 1.0\'s RETURNS TABLE, in order');

my $counters = sql('up', $counters_sql);

# The statement prepared under 1.0 is planned again against 1.1.
is($session->query_safe('EXECUTE replay_ok'), 'replay|201',
	'session: the statement prepared under 1.0 still replays ok-1');

# Finished keys replay their results.
is_deeply(claim($node, 'up', q{'ok-1', request => '{"order": 1}'}),
	replay_row('succeeded', 201, $md5{ok}), 'up: ok-1 replays its stored success');
is_deeply(claim($node, 'up', q{'fail-1', request => '{"order": 2}'}),
	replay_row('failed', 402, $md5{failed}), 'up: fail-1 replays its stored failure');
is_deeply(claim($node, 'up', q{'ok-1', request => '{"order": 3}'}),
	mismatch_row(), 'up: ok-1 with another request is a mismatch');
is(claim($node, 'up', q{'kept-pending'})->{outcome}, 'in_progress',
	'up: kept-pending is still in progress');

# The pending key $key (request $request) refuses a finish with the token
# $bad (55006: not its current token) and stays as it was; then the token
# $good finishes it with the body $body{$body_name}, and it replays that.
sub refuses_then_finishes
{
	my ($key, $request, $bad, $bad_what, $good, $good_what, $body_name) = @_;
	my $row = rows('up', "'$key'");
	is(sqlstate_of($node, 'up', "SELECT idempotency.idem_finish('$key', $bad, 500)"),
		'55006', "up: $key refuses $bad_what (55006)");
	is(rows('up', "'$key'"), $row, "up: $key is unchanged");
	is( sqlstate_of($node, 'up',
			"SELECT idempotency.idem_finish('$key', $good, 200, $body{$body_name})"),
		'00000', "up: $key is finished with $good_what");
	is_deeply(claim($node, 'up', "'$key', request => '$request'"),
		replay_row('succeeded', 200, $md5{$body_name}), "up: $key replays the new result");
	return;
}

# Pending keys: their owners' tokens from 1.0 are still current.
refuses_then_finishes('live-1', '{"job": 1}', $live2, 'the token of another key',
	$live1, 'its 1.0 token', 'live1');
is(sqlstate_of($node, 'up', "SELECT idempotency.idem_finish('live-1', $live2, 201)"),
	'55000', 'up: a finish of live-1 with another token is refused (55000)');

is( sqlstate_of($node, 'up',
		"SELECT idempotency.idem_extend('live-2', $live2, '2 hours')"),
	'00000', 'up: live-2 is extended with its 1.0 token');
is( sqlstate_of($node, 'up',
		"SELECT idempotency.idem_finish('live-2', $live2, 200, $body{live2})"),
	'00000', 'up: live-2 is finished with its 1.0 token');
is_deeply(claim($node, 'up', q{'live-2', request => '{"job": 2}'}),
	replay_row('succeeded', 200, $md5{live2}), 'up: live-2 replays the new result');

# The key whose lease ended is taken over.
$c = claim($node, 'up', q{'ended', request => '{"job": 9}', lease => '1 hour'});
is($c->{outcome}, 'claimed', 'up: "ended" is claimed again');
is($c->{attempt}, 2,         'up: as attempt 2');
cmp_ok($c->{token}, '>', max(@tokens), 'up: with a token larger than every token 1.0 issued');
refuses_then_finishes('ended', '{"job": 9}', $ended, 'the dead token of attempt 1',
	$c->{token}, 'the token of attempt 2', 'taken');
my $takeover_token = $c->{token};

is($session->query_safe("EXECUTE claim_new('after')"), 'claimed|1',
	'session: the claim prepared under 1.0 claims a new key');
cmp_ok(sql('up', "SELECT token FROM idempotency.keys WHERE key = 'after'"),
	'>', $takeover_token, 'up: with the next larger token');
$session->quit;

is(rows('up', q{'ok-1', 'fail-1', 'kept-done', 'kept-pending'}),
	join("\n", grep { /'(ok-1|fail-1|kept-done|kept-pending)'/ } split /\n/, $before{rows}),
	'up: the rows the test only read are the tuples from before the update');

# The stats view: key counts from the table, counters moving on from where
# they were.  Since the update: claims 2 (the takeover, "after"), takeovers 1,
# replays 6, in_progress 1, mismatches 1, finishes 3, releases 0.
is(sql('up', $key_counts_sql), '2,5,1', 'up: stats: 2 pending, 5 succeeded, 1 failed keys');
is(sql('up', $counters_sql), counters_plus($counters, 2, 1, 6, 1, 1, 3, 0),
	'up: stats: the counters count every call since the update');

# The dump taken under 1.0 restores into the newest version (a dump names
# none) with every key.
my $newest = sql('postgres',
	"SELECT default_version FROM pg_available_extensions WHERE name = 'idempotency'");
sql('postgres', 'CREATE DATABASE up_copy');
$node->command_ok(
	[ 'pg_restore', '--exit-on-error', '-d', $node->connstr('up_copy'), "$dir/up.dump" ],
	'up_copy: the 1.0 dump is restored');
is(ext_state('up_copy'), "$newest|$setof_result|t|1", "up_copy: as $newest, the newest");
(my $before_columns = $before{rows}) =~ s/^[^|]*\|[^|]*\|//mg;
(my $copy_columns = rows('up_copy')) =~ s/^[^|]*\|[^|]*\|//mg;
is($copy_columns, $before_columns, 'up_copy: every key is restored, column for column');
is_deeply(claim($node, 'up_copy', q{'ok-1', request => '{"order": 1}'}),
	replay_row('succeeded', 201, $md5{ok}), 'up_copy: ok-1 replays its stored success');
is( sqlstate_of($node, 'up_copy',
		"SELECT idempotency.idem_finish('live-1', $live1, 200, $body{live1})"),
	'00000', 'up_copy: live-1 is finished with its 1.0 token');

# =========================================================================
# The updated catalog is a fresh 1.1 install's
# =========================================================================
sql('postgres', 'CREATE DATABASE fresh');
sql('fresh', "CREATE EXTENSION idempotency VERSION '1.1'");
is(ext_state('fresh'), "1.1|$setof_result|t|1",
	'fresh: CREATE EXTENSION ... VERSION \'1.1\' installs 1.1');

my %catalog = catalog_queries();
foreach my $what (sort keys %catalog)
{
	my $fresh = sql('fresh', $catalog{$what});
	isnt($fresh, '', "fresh: $what: the query finds something");
	is(sql('up', $catalog{$what}), $fresh, "up = fresh: $what");
}
like(sql('fresh', $catalog{'functions (definition, owner, privileges)'}),
	qr/FUNCTION idempotency\.idem_claim\(.*\n RETURNS SETOF idempotency\.claim_result\n LANGUAGE c\n ROWS 1\nAS '\$libdir\/idempotency', \$function\$idem_claim\$function\$\nowner postgres, acl default\n/,
	'fresh: idem_claim is SETOF claim_result, C, ROWS 1, default privileges');
is(sql('fresh', $catalog{'claim_result columns'}),
	    '1 outcome text "default", 2 token bigint -, 3 attempt integer -, '
	  . '4 status text "default", 5 response_code integer -, 6 response_body jsonb -, '
	  . '7 retry_after integer -',
	'fresh: claim_result has 1.0\'s RETURNS TABLE columns, in order');
like(sql('fresh', $catalog{'extension members'}), qr/^type idempotency\.claim_result$/m,
	'fresh: claim_result is a member of the extension');

# =========================================================================
# Privileges an administrator changed under 1.0 carry over
# =========================================================================
sql('postgres', 'CREATE DATABASE acl');
sql('acl', "CREATE EXTENSION idempotency VERSION '1.0'");
sql('acl', 'CREATE ROLE regress_lead; CREATE ROLE regress_worker; CREATE ROLE "Regress App"');
grant_claim_per_role($node, 'acl');
my $acl_sql = "SELECT proacl FROM pg_proc WHERE oid = '$claim_sig'::regprocedure";
my $acl = sql('acl', $acl_sql);
like($acl, qr/regress_worker=X\/regress_lead/,
	'acl: under 1.0, regress_lead granted EXECUTE to regress_worker');

# Another superuser than the one who installed 1.0 runs the update.
sql('acl', 'CREATE ROLE regress_admin SUPERUSER LOGIN');
is( $node->safe_psql('acl',
		"ALTER EXTENSION idempotency UPDATE TO '1.1'; "
		  . "SELECT current_setting('role') || ',' || current_user",
		extra_params => [ '-U', 'regress_admin' ]),
	'none,regress_admin', 'acl: the update succeeds and leaves the session\'s role alone');
is(ext_state('acl'), "1.1|$setof_result|t|1", 'acl: updated to 1.1');
is( sql('acl',
		    "SELECT proowner::regrole || ',' || (SELECT typowner::regrole FROM pg_type "
		  . "WHERE oid = 'idempotency.claim_result'::regtype) "
		  . "FROM pg_proc WHERE oid = '$claim_sig'::regprocedure"),
	'postgres,postgres', 'acl: idem_claim and claim_result keep 1.0\'s owner');
is(sql('acl', $acl_sql), $acl, 'acl: idem_claim has the same privileges, grantors and order');
is( sql('acl',
		    "SELECT string_agg(r || '=' || has_function_privilege(r, '$claim_sig', "
		  . "'EXECUTE'), ',' ORDER BY r) FROM unnest(ARRAY['public', 'regress_lead', "
		  . "'regress_worker', 'Regress App']) AS r"),
	'Regress App=true,public=false,regress_lead=true,regress_worker=true',
	'acl: PUBLIC may not execute idem_claim, the granted roles may');
is( sql('acl',
		"SELECT count(*) FROM pg_init_privs WHERE objoid = '$claim_sig'::regprocedure"),
	'0', 'acl: they are the administrator\'s, not the extension\'s initial privileges');
is(sql('acl', "SET ROLE regress_worker; SELECT outcome FROM idempotency.idem_claim('w')"),
	'claimed', 'acl: regress_worker claims a key');

# A dump restores into the newest version, whose idem_claim has more
# arguments than 1.1's, and names idem_claim by its arguments in its GRANTs:
# so the source is updated to the newest version before the dump, as
# docs/upgrading.md says (in a copy, so that this database stays at 1.1).
sql('postgres', 'CREATE DATABASE acl_src TEMPLATE acl');
sql('acl_src', 'ALTER EXTENSION idempotency UPDATE');
my $acl_by_name_sql = "SELECT proacl FROM pg_proc WHERE proname = 'idem_claim' "
  . "AND pronamespace = 'idempotency'::regnamespace";
is(sql('acl_src', $acl_by_name_sql), $acl,
	'acl_src: updated to the newest version, idem_claim keeps its privileges');
$node->command_ok([ 'pg_dump', '-Fp', '-d', $node->connstr('acl_src'), '-f', "$dir/acl.sql" ],
	'acl: pg_dump');
sql('postgres', 'CREATE DATABASE acl_copy');
$node->command_ok(
	[
		'psql', '-X', '-q', '-v', 'ON_ERROR_STOP=1', '-d', $node->connstr('acl_copy'),
		'-f', "$dir/acl.sql"
	],
	'acl: the dump is restored into a fresh database');
is(sql('acl_copy', $acl_by_name_sql), $acl, 'acl_copy: the dump carried idem_claim\'s privileges');

# From PostgreSQL 17 on, the initial privileges that the update's grants
# record come with a shared dependency on each role they name; the update
# removes both, so once their grants are revoked the roles can be dropped.
is(stale_initacl_deps($node, 'acl'), '',
	'acl: no role dependency of initial privileges outlives them');
sql('postgres', 'DROP DATABASE acl_copy');
sql('postgres', 'DROP DATABASE acl_src');
revoke_claim_per_role($node, 'acl');
my ($state, $out, $err) =
  sql_result($node, 'acl', 'DROP ROLE regress_worker, regress_lead, "Regress App"');
is($state, '00000', 'acl: with their grants revoked, the granted roles can be dropped')
  or diag($err);

# =========================================================================
# Objects that use idem_claim stop the update
# =========================================================================
sql('postgres', 'CREATE DATABASE dep');
sql('dep', "CREATE EXTENSION idempotency VERSION '1.0'");
finish_key($node, 'dep', 'dep-1', '1 hour', q{'{"v": 1}'});
sql('dep',
	"CREATE VIEW public.claim_view AS SELECT outcome, response_code "
	  . "FROM idempotency.idem_claim('dep-1')");
my $dep_rows = rows('dep');

($state, $out, $err) =
  sql_result($node, 'dep', "ALTER EXTENSION idempotency UPDATE TO '1.1'");
is($state, '2BP01', 'dep: a view on idem_claim makes the update fail (2BP01)');
like($err, qr/view public\.claim_view depends on function idem_claim/,
	'dep: the error names the view');
is(ext_state('dep'), "1.0|$table_result|f|1", 'dep: the extension is still 1.0, unchanged');
is(rows('dep'), $dep_rows, 'dep: the stored rows are unchanged');
is(sql('dep', 'SELECT outcome, response_code FROM public.claim_view'), 'replay|200',
	'dep: the view still replays');
$c = claim($node, 'dep', q{'dep-2', lease => '1 hour'});
is($c->{outcome}, 'claimed', 'dep: 1.0 still claims');
is( sqlstate_of($node, 'dep',
		"SELECT idempotency.idem_finish('dep-2', $c->{token}, 204)"),
	'00000', 'dep: and finishes');
is_deeply(claim($node, 'dep', q{'dep-2'}), replay_row('succeeded', 204, undef),
	'dep: and replays');
is(sql('dep', "SELECT status FROM idempotency.idem_lookup('dep-2')"), 'succeeded',
	'dep: and looks keys up');
is(sql('dep', $key_counts_sql), '0,2,0', 'dep: the stats view answers');

sql('dep', 'DROP VIEW public.claim_view');
sql('dep',
	    "CREATE FUNCTION public.claim_outcome(k text) RETURNS text LANGUAGE sql "
	  . "BEGIN ATOMIC SELECT outcome FROM idempotency.idem_claim(k); END");
($state, $out, $err) =
  sql_result($node, 'dep', "ALTER EXTENSION idempotency UPDATE TO '1.1'");
is($state, '2BP01', 'dep: a BEGIN ATOMIC function on idem_claim makes the update fail (2BP01)');
like($err, qr/function public\.claim_outcome\(text\) depends on function idem_claim/,
	'dep: the error names the function');
is(ext_state('dep'), "1.0|$table_result|f|1", 'dep: still 1.0');

# What the documentation says to do: drop, update, create again.
sql('dep', 'DROP FUNCTION public.claim_outcome(text)');
is(sqlstate_of($node, 'dep', "ALTER EXTENSION idempotency UPDATE TO '1.1'"), '00000',
	'dep: with the dependents dropped, the update succeeds');
sql('dep',
	"CREATE VIEW public.claim_view AS SELECT outcome, response_code "
	  . "FROM idempotency.idem_claim('dep-1')");
sql('dep',
	    "CREATE FUNCTION public.claim_outcome(k text) RETURNS text LANGUAGE sql "
	  . "BEGIN ATOMIC SELECT outcome FROM idempotency.idem_claim(k); END");
is(ext_state('dep'), "1.1|$setof_result|t|1", 'dep: 1.1');
is(sql('dep', 'SELECT outcome, response_code FROM public.claim_view'), 'replay|200',
	'dep: the view, created again, replays');
is(sql('dep', "SELECT public.claim_outcome('dep-2')"), 'replay',
	'dep: so does the function');

$node->stop;
done_testing();
